"""`mpi-tp train --cp Z` over mpiexec: the serial run's losses and checkpoint, and one line for what cp does
not run."""
import json
import os

import h5py
import numpy as np
import pytest
from jobs import MPIEXEC, mpirun

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "11", "--batch-size", "2",
        "--steps", "3", "--eval-batches", "1", "--dtype", "float64", "--dropout", "0.1", "--sample-len", "0"]


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_at_cp_2_equals_the_serial_run(tmp_path):
    runs = {}
    for n, layout in ((1, []), (2, ["--cp", "2"])):
        out = str(tmp_path / f"cp{n}")
        r = mpirun(n, "train", *TINY, *layout, "--log-every", "1", "--out", out)
        assert r.returncode == 0, r.stderr
        runs[n] = out
    a, b = ([m["loss"] for m in metrics(runs[k]) if "loss" in m] for k in (1, 2))
    assert len(a) == 3 and np.allclose(a, b, rtol=1e-9, atol=0), (a, b)
    with h5py.File(os.path.join(runs[2], "checkpoints", "step-00000003", "index.h5")) as f, \
            h5py.File(os.path.join(runs[1], "checkpoints", "step-00000003", "index.h5")) as g:
        assert json.loads(f.attrs["layout"])["cp"] == 2
        w, v = f["model/h/1/mlp/fc/weight"][...], g["model/h/1/mlp/fc/weight"][...]
        assert np.allclose(w, v, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("args,says", [
    (["--cp", "2", "--moe-experts", "4", "--ep", "4"], "--ep 4 x --etp 1 = 4 must divide tp x cp x dp = 2"),
    (["--cp", "3"], "needs 3 MPI ranks but the job has 2"),
    (["--cp", "2", "--block-size", "3"], "too short (at least 4)"),
])
def test_what_cp_does_not_run_is_one_line(tmp_path, args, says):
    r = mpirun(2, "train", *TINY, *args, "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1 and says in r.stderr, r.stderr


def test_explain_draws_the_ring_and_checks_it():
    r = mpirun(3, "explain", "--layer", "cp", "--seq", "11")
    assert r.returncode == 0 and "PASS" in r.stdout and r.stdout.count(": equal") == 3, r.stdout + r.stderr
    assert "plain split [" in r.stdout and "query  10 (rank 0)" in r.stdout
