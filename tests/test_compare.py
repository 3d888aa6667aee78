"""`mpi-tp compare A B` on tiny float64 runs: a run against itself (every difference 0), the same run at two
layouts (tp 2 and dp 2 on the same global batch: rounding only, KL below 1e-9), two seeds (far apart, and
--fail-above exits 1), and each bad input's one line. Every comparison checks how many tensors it compared
(the checkpoint's own count, read with h5py) and how many positions the KL ran on, so a compare that
compared nothing fails."""
import json
import shutil

import h5py
import pytest
from jobs import MPIEXEC, mpirun

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")

STEPS = 3
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--steps", str(STEPS),
        "--log-every", "1", "--eval-every", "3", "--eval-batches", "1", "--sample-len", "0", "--dtype", "float64"]
WINDOWS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder}: tp2 and dp2 see the same global batch of 4 (dp2: 2 rows per replica); seed7 is
    another initialisation; wide another model."""
    root = tmp_path_factory.mktemp("compare")
    layouts = {"tp2": ["--tp", "2", "--batch-size", "4"], "dp2": ["--tp", "1", "--dp", "2", "--batch-size", "2"],
               "seed7": ["--tp", "2", "--batch-size", "4", "--seed", "7"],
               "wide": ["--tp", "2", "--batch-size", "4", "--n-embd", "32"]}
    out = {}
    for name, layout in layouts.items():
        r = mpirun(2, "train", *TINY, *layout, "--out", str(root / name))
        assert r.returncode == 0, r.stderr
        out[name] = root / name
    return out


def saved_tensors(run, prefix="model/") -> int:
    """How many tensors under prefix the run's last checkpoint holds (h5py, not mpi_tp)."""
    with h5py.File(run / "checkpoints" / f"step-{STEPS:08d}" / "index.h5", "r") as f:
        names = []
        f.visit(lambda n: names.append(n) if n.startswith(prefix) and isinstance(f[n], h5py.Dataset) else None)
    return len(names)


def compare(n, a, b, *options):
    r = mpirun(n, "compare", str(a), str(b), "--windows", str(WINDOWS), *options)
    report = json.loads(r.stdout) if r.returncode in (0, 1) and "--json" in options else None
    return r, report


def ran_everything(report, run, prefix="model/"):
    """The report compared every saved tensor, both loss curves' every step, and the KL's positions."""
    assert report["tensors"]["compared"] == saved_tensors(run, prefix) > 0
    assert report["tensors"]["only_a"] == report["tensors"]["only_b"] == []
    assert report["loss"]["loss"]["steps"] == STEPS
    assert report["kl"]["tokens"] == WINDOWS * 16


def test_a_run_against_itself_is_zero(runs):
    r, report = compare(1, runs["tp2"], runs["tp2"], "--json", "--optim", "--fail-above", "0")
    assert r.returncode == 0, r.stderr
    ran_everything(report, runs["tp2"], prefix=("model/", "optim/"))
    assert report["tensors"]["compared"] == 3 * saved_tensors(runs["tp2"])       # model/, optim/m, optim/v
    assert all(t["max_abs"] == 0 for t in report["tensors"]["tensors"])
    assert report["loss"]["loss"]["max_abs"] == 0 and report["loss"]["val_loss"]["max_abs"] == 0
    assert report["kl"]["mean_kl"] == report["kl"]["max_kl"] == 0 and report["kl"]["top1_agreement"] == 1


def test_two_layouts_of_one_run_agree_in_float64(runs):
    """tp2 and dp2 on the same global batch: the serial model's numbers to rounding (float64), at 2 ranks
    (the KL runs tensor-parallel over them)."""
    r, report = compare(2, runs["tp2"], runs["dp2"], "--json", "--fail-above", "1e-6")
    assert r.returncode == 0, r.stderr
    ran_everything(report, runs["tp2"])
    assert report["loss"]["loss"]["max_abs"] < 1e-12
    worst = report["tensors"]["tensors"][0]
    assert worst["max_rel"] < 1e-6 and worst["max_abs"] < 1e-12, worst          # rounding at most
    assert 0 <= report["kl"]["mean_kl"] < 1e-9 and report["kl"]["max_kl"] < 1e-9
    assert report["kl"]["top1_agreement"] == 1 and report["failed"] == []


def test_two_seeds_differ_and_fail_above_exits_1(runs, tmp_path):
    r, report = compare(1, runs["tp2"], runs["seed7"], "--json")
    assert r.returncode == 0, r.stderr
    ran_everything(report, runs["tp2"])
    assert report["tensors"]["tensors"][0]["max_rel"] > 0.1
    assert report["loss"]["loss"]["max_abs"] > 1e-4
    assert report["kl"]["mean_kl"] > 1e-4 and report["kl"]["top1_agreement"] < 1
    r, _ = compare(1, runs["tp2"], runs["seed7"], "--fail-above", "1e-3", "--top", "3")
    assert r.returncode == 1, r.stderr
    assert f"{saved_tensors(runs['tp2'])} compared by name" in r.stdout
    assert "KL(A||B) mean" in r.stdout and len(r.stdout.splitlines()) == 2 + 1 + 1 + STEPS + 1 + 2 + 3 + 1
    assert r.stderr.count("above --fail-above 0.001") == 1 and "mean KL" in r.stderr


def test_a_conversion_gate(runs, tmp_path):
    """The tp2 run exported as Hugging Face folders at float32 and bfloat16, against its checkpoint: each
    tensor within its format's unit roundoff (2^-24, 2^-8) of the float64 one, relative to its largest value."""
    pytest.importorskip("safetensors")
    for dtype, roundoff, passes in (("float32", 2.0 ** -24, True), ("bfloat16", 2.0 ** -8, False)):
        folder = tmp_path / dtype
        r = mpirun(1, "export", str(runs["tp2"] / "checkpoints"), str(folder), "--format", "hf", "--dtype", dtype)
        assert r.returncode == 0, r.stderr
        r, report = compare(1, runs["tp2"], folder, "--json", "--fail-above", "1e-6")
        assert r.returncode == (0 if passes else 1), r.stderr
        assert report["tensors"]["compared"] == saved_tensors(runs["tp2"]) and report["kl"]["tokens"] == WINDOWS * 16
        worst = report["tensors"]["tensors"][0]["max_rel"]
        assert roundoff / 16 < worst <= roundoff, (dtype, worst)
        assert report["kl"]["mean_kl"] < (1e-9 if passes else 1e-3) and "loss" not in report["loss"]


def test_plot(runs, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "ab.png"
    r, _ = compare(1, runs["tp2"], runs["seed7"], "--windows", "0", "--plot", str(png))
    assert r.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.stderr


def test_bad_input_is_one_line(runs, tmp_path):
    shifted = tmp_path / "shifted"                # the same run, its metrics logged at other steps
    shutil.copytree(runs["tp2"], shifted)
    lines = [json.loads(line) for line in (shifted / "metrics.jsonl").read_text().splitlines()]
    (shifted / "metrics.jsonl").write_text("".join(json.dumps({**m, "step": m["step"] + 100}) + "\n" for m in lines))
    (tmp_path / "empty").mkdir()
    (tmp_path / "nothing.txt").write_bytes(b"abc")
    cases = {"not a folder": ([tmp_path / "nothing", runs["tp2"]], "is not a folder"),
             "none of the kinds": ([tmp_path / "empty", runs["tp2"]], "is none of a run folder"),
             "another model": ([runs["tp2"], runs["wide"]], "different models: n_embd = 16 in A"),
             "no common step": ([runs["tp2"], shifted], "share no step"),
             "data shorter than a window": ([runs["tp2"], runs["dp2"], "--data", tmp_path / "nothing.txt"],
                                            "nothing.txt has 3 tokens; one window needs 17"),
             "no such step": ([runs["tp2"], runs["dp2"], "--step-b", "2"], "B (" )}
    for what, (argv, says) in cases.items():
        r = mpirun(2, "compare", *map(str, argv))
        assert r.returncode == 2, (what, r.stdout, r.stderr)
        assert r.stderr.count("mpi-tp: error:") == 1 and says in r.stderr, (what, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == "", (what, r.stderr)
    assert "has no checkpoint at step 2 (its steps: 3)" in r.stderr


def test_the_json_report_is_strict_json():
    """A non-finite difference (tensors whose shapes differ) prints as null, not as Infinity (not JSON)."""
    from mpi_tp.commands.compare import finite
    report = {"tensors": [["model/wte", float("inf"), 1.0]], "kl": {"max": float("nan")}, "steps": (1, 2)}
    assert json.dumps(finite(report), allow_nan=False) == \
        '{"tensors": [["model/wte", null, 1.0]], "kl": {"max": null}, "steps": [1, 2]}'
