"""Resume anywhere: a run saved at one layout and resumed with `--resume` at another (world size, tp, sp, cp,
pp, dp, ZeRO-1, ep) continues as the other layout's uninterrupted run does: the same losses and gradient
norms at every step after the save, and the same weights and AdamW moments (m and v) at the end (float64,
dropout on). The user gives the new layout only: the checkpoint's global batch is kept (the per-replica
batch follows), so no batch size is recomputed by hand (config_sources.keep_global_batch)."""
import json

import h5py
import numpy as np
import pytest
from jobs import MPIEXEC, mpirun

from mpi_tp.core.testing import max_rel_diff

cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
COMMON = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--sample-len", "0",
          "--dtype", "float64", "--dropout", "0.1", "--eval-batches", "1", "--log-every", "1", "--lr", "3e-3"]
MOE = ["--moe-experts", "2", "--moe-top-k", "1"]
SAVED, END = 2, 4                       # the save's step, the last step
RTOL = 1e-9                             # float64: layouts differ in the order of their sums only

# name: (ranks, saved layout, ranks, resumed layout); the global batch is 4 sequences throughout
PAIRS = {
    "tp2-dp2-zero1 -> pp2": (4, ["--tp", "2", "--dp", "2", "--zero", "1", "--batch-size", "2"],
                             2, ["--pp", "2", "--micro-batches", "2"]),
    "pp2 -> dp2-zero1": (2, ["--pp", "2", "--micro-batches", "4", "--batch-size", "1"], 2, ["--dp", "2", "--zero", "1"]),
    "tp2-sp -> cp2": (2, ["--tp", "2", "--sequence-parallel", "--batch-size", "4"], 2, ["--cp", "2"]),
    "serial -> tp2-dp2": (1, ["--batch-size", "4"], 4, ["--tp", "2", "--dp", "2"]),
    "moe dp2-ep2 -> moe tp2": (2, [*MOE, "--dp", "2", "--ep", "2", "--batch-size", "2"], 2, [*MOE, "--tp", "2"]),
}


def steps_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def tensors(out, step: int) -> dict:
    """The model/ and optim/ tensors of the run's checkpoint of `step`, whole (the index's virtual view)."""
    with h5py.File(out / "checkpoints" / f"step-{step:08d}" / "index.h5", "r") as f:
        names = []
        f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) and n.startswith(("model/", "optim/"))
                else None)
        return {n: f[n][...] for n in names}


def option(options: list, name: str) -> int:
    """The value of --name among options (1 when absent: the default of --dp and --micro-batches)."""
    return int(options[options.index(name) + 1]) if name in options else 1


def train(n, out, *options):
    r = mpirun(n, "train", *COMMON, *options, "--out", str(out))
    assert r.returncode == 0, r.stderr
    return r


@cli
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_resumed_at_another_layout_equals_that_layouts_run(tmp_path, pair):
    n_saved, saved, n_resumed, resumed = PAIRS[pair]
    run, straight = tmp_path / "run", tmp_path / "straight"
    train(n_saved, run, *saved, "--steps", str(SAVED))
    r = train(n_resumed, run, *resumed, "--steps", str(END), "--resume")
    assert f"continuing from {run}/checkpoints/step-{SAVED:08d} (step {SAVED})" in r.stdout, r.stdout
    if any(option(saved, k) != option(resumed, k) for k in ("--dp", "--micro-batches")):
        assert "the global batch of 4 sequences kept" in r.stdout, r.stdout
    batch = 4 // (option(resumed, "--dp") * option(resumed, "--micro-batches"))
    train(n_resumed, straight, *resumed, "--batch-size", str(batch), "--steps", str(END))
    got, want = steps_of(run)[-(END - SAVED):], steps_of(straight)[SAVED:]
    assert [s["step"] for s in got] == [s["step"] for s in want] == list(range(SAVED + 1, END + 1))
    for key in ("loss", "grad_norm"):            # the gradient's norm, step by step
        assert max_rel_diff(np.array([s[key] for s in got]), np.array([s[key] for s in want])) <= RTOL, (pair, key)
    a, b = tensors(run, END), tensors(straight, END)
    assert a.keys() == b.keys() and any(k.startswith("optim/m/") for k in a) and any(k.startswith("optim/v/") for k in a)
    # attn/k/bias: its exact gradient is 0 (softmax cancels it), so its value and moments are rounding noise
    # at every layout (docs/tensor_parallelism.md); every other tensor, weights and both moments, compared
    worst = max((k for k in a if not k.endswith("attn/k/bias")), key=lambda k: max_rel_diff(a[k], b[k]))
    assert max_rel_diff(a[worst], b[worst]) <= RTOL, (pair, worst)


@cli
def test_a_global_batch_the_new_layout_cannot_split_is_one_line(tmp_path):
    run = tmp_path / "run"
    train(2, run, "--dp", "2", "--batch-size", "2", "--steps", "1")              # a global batch of 4
    r = mpirun(3, "train", *COMMON, "--dp", "3", "--steps", "2", "--out", str(run), "--resume")
    assert r.returncode != 0
    said = [line for line in r.stderr.splitlines() if "global batch" in line]
    assert len(said) == 1 and "4 sequences" in said[0] and "dp 3" in said[0], r.stderr
    assert "Traceback" not in r.stderr


@cli
def test_a_batch_size_given_changes_the_global_batch_and_says_so(tmp_path):
    run = tmp_path / "run"
    train(2, run, "--dp", "2", "--batch-size", "2", "--steps", "1")
    r = train(2, run, "--dp", "2", "--batch-size", "3", "--steps", "2", "--resume")
    assert "the global batch changes from 4 to 6 sequences (--batch-size given)" in r.stdout, r.stdout


@cli
def test_the_validation_loss_is_the_same_at_every_layout(tmp_path):
    """Validation batches are global batches, each replica evaluating its rows in its micro-batches: tp2,
    dp2 and pp2 x 2 micro-batches of one global batch report the same validation loss (it once drew batches
    of the per-replica size, so dp2 evaluated other sequences than tp2)."""
    val = {}
    for name, layout in {"tp2": ["--tp", "2", "--batch-size", "8"], "dp2": ["--dp", "2", "--batch-size", "4"],
                         "pp2": ["--pp", "2", "--micro-batches", "2", "--batch-size", "4"]}.items():
        train(2, tmp_path / name, *layout, "--steps", "2", "--eval-every", "1", "--eval-batches", "2")
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        val[name] = np.array([line["val_loss"] for line in lines if "val_loss" in line])
    assert len(val["tp2"]) == 2
    assert max_rel_diff(val["dp2"], val["tp2"]) <= RTOL and max_rel_diff(val["pp2"], val["tp2"]) <= RTOL, val
