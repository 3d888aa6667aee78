"""`mpi-tp train`'s layout options reach the model, the reducer and the optimizer: each run with an option
differs from the same run without it in what only the option does (run.json's counters and memory), so a
flag dropped on its way from the command line cannot pass for a run that honoured it (the numbers alone
would: every option changes no number)."""
import functools
import json

import pytest
from jobs import MPIEXEC, mpirun

cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
COMMON = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "2",
          "--sample-len", "0", "--steps", "1", "--eval-batches", "1"]


@functools.cache
def _run(root: str, *options: str) -> dict:
    out = f"{root}/{'_'.join(o.strip('-') for o in options) or 'plain'}"
    r = mpirun(2, "train", *COMMON, *options, "--out", out)
    assert r.returncode == 0, r.stderr
    with open(f"{out}/run.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("flags"))
    return lambda *options: _run(root, *options)


def calls(run_json: dict) -> dict:
    """The training steps' collective calls, by group/kind."""
    return {k: v["calls"] for k, v in run_json["communication"]["train_steps"].items()}


@cli
def test_sequence_parallel_reaches_the_model(run):
    """Only sequence parallelism gathers a column layer's input again in the backward (tp/regather)."""
    assert "tp/regather" not in calls(run("--tp", "2"))
    assert calls(run("--tp", "2", "--sequence-parallel"))["tp/regather"] > 0


@cli
def test_recompute_reaches_the_model(run):
    """Full recomputation runs each block's forward again in the backward: its two all-reduces per block
    (g after attention and after the MLP) come twice."""
    plain, again = calls(run("--tp", "2"))["tp/all_reduce"], calls(run("--tp", "2", "--recompute", "full"))
    assert again["tp/all_reduce"] == plain + 2 * 2, (plain, again)


@cli
def test_zero_reaches_the_reducer_and_the_optimizer(run):
    """ZeRO-1 reduce-scatters the gradients (no all-reduce of them) and keeps half the optimizer state
    per replica at dp 2."""
    plain, zero = run("--dp", "2"), run("--dp", "2", "--zero", "1")
    assert "dp/iall_reduce" in calls(plain) and "dp/reduce_scatter" not in calls(plain)
    assert "dp/reduce_scatter" in calls(zero) and "dp/iall_reduce" not in calls(zero)
    assert max(zero["memory_mib"]["optimizer"]) < 0.6 * max(plain["memory_mib"]["optimizer"])
