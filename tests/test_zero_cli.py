"""ZeRO-2 and ZeRO-3 through the mpi-tp command: what a 2-rank run holds and sends, and verify at --zero 3.

These tests start their own MPI jobs: they carry the launcher mark and no mpi one (tests/run.sh)."""
import json

import pytest
from jobs import MPIEXEC, mpirun

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


@pytest.mark.launcher
def test_train_zero_reaches_the_reducer(tmp_path):
    """`mpi-tp train --dp 2 --zero 2` holds half of plain data parallelism's gradient bytes after the step
    and reduce-scatters as ZeRO-1 does; --zero 3 half its weights as well, and gathers layer by layer."""
    runs = {}
    for zero in (0, 2, 3):
        out = tmp_path / f"zero{zero}"
        r = mpirun(2, "train", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
                   "--batch-size", "2", "--sample-len", "0", "--steps", "1", "--eval-batches", "1", "--dp", "2",
                   "--zero", str(zero), "--out", str(out))
        assert r.returncode == 0, r.stderr
        runs[zero] = json.loads((out / "run.json").read_text())
    mem = {z: {k: max(v) for k, v in r["memory_mib"].items()} for z, r in runs.items()}
    kinds = {z: set(r["communication"]["train_steps"]) for z, r in runs.items()}
    assert mem[2]["gradients"] == pytest.approx(mem[0]["gradients"] / 2, rel=1e-3), mem
    assert mem[3]["gradients"] == pytest.approx(mem[0]["gradients"] / 2, rel=1e-3), mem
    assert mem[3]["weights"] == pytest.approx(mem[0]["weights"] / 2, rel=1e-3), mem
    assert mem[2]["weights"] == mem[0]["weights"], mem
    assert "dp/reduce_scatter" in kinds[2] and "dp/zero3_gather" not in kinds[2], kinds
    assert {"dp/zero3_gather", "dp/zero3_reduce_scatter"} <= kinds[3] and "dp/reduce_scatter" not in kinds[3], kinds


@pytest.mark.launcher
def test_verify_runs_zero3():
    """`mpi-tp verify --zero 3` compares every gradient share and every (gathered) parameter by name."""
    r = mpirun(2, "verify", "--dp", "2", "--zero", "3", "--dropout", "0.1", "--n-layer", "2", "--n-embd", "16",
               "--n-head", "2", "--block-size", "16")
    assert r.returncode == 0 and "every step agrees with the serial model" in r.stdout, r.stdout + r.stderr
