"""`mpi-tp verify`: every layout the suite covers agrees with the serial model, step by step, tensor by
tensor (in process, at the suite's world size); each planted bug (mpi_tp.core.failpoints.PLANTED) is
found and named by its layer or parameter, where a verify that compared losses only would see nothing at
the first step; bad input is one line.

    python -m pytest -q --with-mpi tests/test_verify.py                       (the jobs: 2 and 8 ranks)
    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_verify.py   (N = 1 .. 4)
"""
import json

import pytest
from jobs import MPIEXEC, clean_env, mpirun, run_job

from mpi_tp.commands.cli import build_parser

cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "2",
        "--dropout", "0.1", "--steps", "2"]
LLAMA = ["--arch", "llama", "--n-kv-head", "1"]
MOE = ["--moe-experts", "2", "--moe-top-k", "1"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
               "original_max_position_embeddings": 4}
INTERLEAVED = ["--schedule", "interleaved", "--virtual-stages", "2", "--n-layer", "4"]
LAYOUTS = {     # world size -> the layouts verified at it
    1: [[], ["--micro-batches", "2", "--recompute", "full"], LLAMA],
    2: [["--tp", "2"], ["--tp", "2", "--sequence-parallel", "--recompute", "selective"], ["--pp", "2", "--micro-batches", "2"],
        ["--pp", "2", "--micro-batches", "3", "--schedule", "zb-v", "--virtual-stages", "2", "--n-layer", "4"],
        ["--dp", "2", "--zero", "1"], ["--cp", "2"], [*MOE, "--dp", "2", "--ep", "2"], [*LLAMA, "--tp", "2"],
        [*MOE, "--tp", "2", "--etp", "1", "--ep", "2"], [*MOE, "--cp", "2", "--ep", "2", "--moe-capacity", "1"],
        [*LLAMA, "--qkv-bias", "--tp", "2"],                      # Qwen2's biases on replicated key/value heads
        [*LLAMA, "--rope-scaling", json.dumps(LLAMA3_ROPE), "--tp", "2", "--sequence-parallel"]],
    3: [["--tp", "3", "--n-head", "5", "--n-embd", "20"], ["--dp", "3", "--zero", "1", "--micro-batches", "2"], ["--pp", "3", "--micro-batches", "3", "--n-layer", "3"],
        ["--pp", "3", "--micro-batches", "4", "--n-layer", "3", "--schedule", "zb-h1"]],
    4: [["--tp", "2", "--dp", "2", "--zero", "1"], ["--tp", "2", "--pp", "2", "--micro-batches", "2"],
        ["--tp", "2", "--pp", "2", "--micro-batches", "2", "--schedule", "zb-h1", "--sequence-parallel"],
        ["--cp", "2", "--dp", "2"], ["--pp", "2", "--micro-batches", "2", *INTERLEAVED], [*MOE, "--tp", "2", "--dp", "2", "--ep", "2"],
        [*MOE, "--tp", "2", "--cp", "2", "--ep", "2", "--etp", "1", "--sequence-parallel"]],
}


@pytest.mark.mpi(min_size=1)
def test_every_layout_verifies(world, capsys):
    for layout in LAYOUTS.get(world.Get_size(), []):
        args = build_parser().parse_args(["verify", *TINY, *layout])
        status = args.run(args, world)
        said = capsys.readouterr().out
        assert status == 0, f"{layout}:\n{said}"
        if world.Get_rank() == 0:
            assert "every step agrees with the serial model" in said and said.count(" ok") == 2, said


def verify(n, *options, bug=None):
    env = clean_env()
    if bug:
        env["MPI_TP_FAILPOINT"] = bug
    import sys
    return run_job([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi_tp", "verify", *TINY, *options], env=env)


# planted bug: (layout, the first layer whose output differs or None, the first gradient named)
BUGS = {
    "bug-f-backward": (["--tp", "2"], None, "ln_f/weight"),        # the head's f, the first in the backward
    "bug-bias-before-reduce": (["--tp", "2"], "h/0", None),         # biases start at zero: seen at step 2
    "bug-vocab-offset": (["--tp", "2"], "embedding", None),
    "bug-dropout-replay": (["--tp", "2", "--recompute", "full"], None, "h/1/mlp/proj/weight"),
    "bug-micro-batch-scale": (["--micro-batches", "2"], None, "ln_f/weight"),
    "bug-sp-grads": (["--tp", "2", "--sequence-parallel"], None, "ln_f/weight"),
    "bug-tied-embedding": (["--pp", "2", "--micro-batches", "2"], None, "wte"),
}


@cli
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_planted_bug_is_found_and_named(bug):
    layout, layer, gradient = BUGS[bug]
    r = verify(2, *layout, bug=bug)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    if layer is None:
        assert "forward: every layer's output agrees" in out, out
        # the forward agrees, so the first step's loss does too: a verify of losses alone passes step 1
        assert float(out.split("\n")[2].split()[2]) <= 1e-12, out
    else:
        assert f"forward: the first layer whose output differs is {layer} " in out, out
    if gradient is not None:
        assert f"the order the backward pass computes them, is {gradient} " in out, out


@cli
@pytest.mark.parametrize("layout", [["--tp", "2", "--pp", "2", "--dp", "2", "--micro-batches", "2", "--zero", "1"],
                                    ["--tp", "2", "--cp", "2", "--dp", "2", "--zero", "1"]],
                         ids=["tp2-pp2-dp2", "tp2-cp2-dp2"])
def test_eight_tiny_ranks_verify(layout):
    r = verify(8, *layout, "--n-embd", "8", "--block-size", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every step agrees with the serial model" in r.stdout


@cli
@pytest.mark.parametrize("options,said", [
    (["--steps", "0"], "--steps 0: verify at least one step"),
    (["--tp", "4"], "the layout tp4 pp1 dp1 needs 4 MPI ranks but the job has 2"),
    (["--out", "x"], "--out: verify writes no run folder"),
    (["--dtype", "float32"], "verify compares in float64"),
    (["--tolerance", "0"], "--tolerance 0.0: give a positive number"),
])
def test_bad_input_is_one_line(options, said):
    r = mpirun(2, "verify", *TINY, *options)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and said in lines[0], r.stderr


@cli
def test_verify_starts_from_a_checkpoint(tmp_path):
    """--init-from: both sides start from the checkpoint's weights, moments and dropout step."""
    out = tmp_path / "run"
    r = mpirun(2, "train", *TINY, "--steps", "2", "--out", str(out), "--sample-len", "0")
    assert r.returncode == 0, r.stderr
    r = mpirun(2, "verify", *TINY, "--dp", "2", "--zero", "1", "--init-from", str(out / "checkpoints"))
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [line.split()[0] for line in r.stdout.splitlines() if line.rstrip().endswith(" ok")]
    assert steps == ["3", "4"], r.stdout                 # the steps after the checkpoint's


@cli
def test_verify_starts_from_a_hugging_face_folder(tmp_path):
    """--init-from a Hugging Face folder (written by export --format hf): no optimizer state, fresh moments."""
    pytest.importorskip("safetensors", reason="the hf extra (safetensors) is not installed")
    out, folder = tmp_path / "run", tmp_path / "hf"
    r = mpirun(2, "train", *TINY, "--steps", "1", "--out", str(out), "--sample-len", "0")
    assert r.returncode == 0, r.stderr
    r = mpirun(1, "export", str(out / "checkpoints"), str(folder), "--format", "hf")
    assert r.returncode == 0, r.stderr
    r = mpirun(2, "verify", *TINY, "--tp", "2", "--init-from", str(folder))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every step agrees with the serial model" in r.stdout and f"from {folder}" in r.stdout


@cli
def test_eight_ranks_every_dimension_with_zero_bubble():
    """tp 2 x pp 2 x dp 2 on 8 tiny ranks (oversubscribed here), sequence parallelism, ZeRO-1, dropout, 2
    micro-batches under zb-h1 and zb-v: every step equals the serial model's (mpi-tp verify)."""
    for schedule in (["--schedule", "zb-h1"], ["--schedule", "zb-v", "--virtual-stages", "2", "--n-layer", "4"]):
        r = mpirun(8, "verify", *TINY, "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1", "--sequence-parallel",
                   "--micro-batches", "2", *schedule)
        assert r.returncode == 0 and "every step agrees with the serial model" in r.stdout, r.stdout + r.stderr


@cli
def test_eight_ranks_every_dimension_with_experts():
    """Mixture of experts on 8 tiny ranks (oversubscribed here), every dimension > 1 in each: tp 2 x pp 2 x
    dp 2 with whole experts over the tp ranks (ep 2, etp 1), sequence parallelism, ZeRO-1, 2 micro-batches;
    and tp 2 x cp 2 x pp 2 with 4 experts over tp x cp (ep 4, etp 1), capacity dropping: every step equals
    the serial model's (mpi-tp verify)."""
    moe = ["--moe-experts", "4", "--moe-top-k", "2", "--micro-batches", "2"]
    for layout in (["--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--etp", "1", "--zero", "1",
                    "--sequence-parallel"],
                   ["--tp", "2", "--cp", "2", "--pp", "2", "--ep", "4", "--etp", "1", "--moe-capacity", "1"]):
        r = mpirun(8, "verify", *TINY, *moe, *layout)
        assert r.returncode == 0 and "every step agrees with the serial model" in r.stdout, r.stdout + r.stderr


@cli
def test_eight_ranks_tensor_context_and_pipeline_together():
    """tp 2 x cp 2 x pp 2 on 8 tiny ranks (issue 42: never tested together before), dropout, 2 micro-batches: GPT-2
    under 1F1B, and a grouped-query Llama under sequence parallelism and zb-h1: every step equals the serial
    model's (mpi-tp verify)."""
    for layout in ([], [*LLAMA, "--sequence-parallel", "--schedule", "zb-h1"]):
        r = mpirun(8, "verify", *TINY, "--tp", "2", "--cp", "2", "--pp", "2", "--micro-batches", "2", *layout)
        assert r.returncode == 0 and "every step agrees with the serial model" in r.stdout, r.stdout + r.stderr
