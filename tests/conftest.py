"""Test-session plumbing for running the suite under mpiexec at several world sizes.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi --only-mpi tests

- MPI_TP_EXPECT_WORLD=N (set by tests/run.sh) makes the session stop at once if
  the launcher started something else (e.g. N one-rank programs).
- After every test the ranks agree on its outcome: a test that failed on one rank
  is reported failed on all, and if the ranks cannot agree within
  MPI_TP_TEST_SYNC_TIMEOUT seconds (one rank failed while the others wait in a
  collective) the job is aborted with a message instead of hanging.
- Every Topology a test creates in its body (Topology.create, .serial, and a
  serial GPT's default) is freed when the test ends, in creation order on every
  rank: an MPI process has a few thousand communicators, and a suite that left
  each test's layouts behind ran out of them ("Too many communicators").
  Fixtures keep theirs (they are made before the body runs).
- Ranks above 0 report on stderr, short (failures and the closing line): stdout
  holds rank 0's report alone, whole lines that the other ranks cannot cut.
- The serving tests' module fixtures: serving_checkpoint (trained by a 2-rank job)
  and serving_serial, its model on this process alone (tests/serving.py).
"""
from __future__ import annotations

import os
import sys
import time

import numpy
import pytest
from mpi4py import MPI

from mpi_tp.parallel.topology import Topology

WORLD = MPI.COMM_WORLD
SYNC_TIMEOUT = float(os.environ.get("MPI_TP_TEST_SYNC_TIMEOUT", "120"))


@pytest.hookimpl(tryfirst=True)          # before pytest's terminal reporter takes sys.stdout
def pytest_configure(config):
    if WORLD.Get_rank() > 0:      # rank 0 reports in full; the others keep to failures and the summary
        # ... on stderr: a launcher forwards each rank's output in pieces, and rank 1's summary landed
        # inside rank 0's last lines, which tests/run.sh reads from stdout
        sys.stdout = sys.stderr
        config.option.verbose = min(config.option.verbose, -1)
        # ... and leave skips out of their short summary, so that the SKIPPED lines tests/run.sh
        # counts (-rs) are rank 0's alone (every rank skips the same tests)
        chars = config.option.reportchars.replace("A", "PpsxXEf").replace("a", "sxXEf")
        config.option.reportchars = chars.replace("s", "").replace("S", "")
    expected = os.environ.get("MPI_TP_EXPECT_WORLD")
    if expected and int(expected) != WORLD.Get_size():
        raise pytest.UsageError(
            f"expected an MPI world of {expected} ranks but this process sees {WORLD.Get_size()}: "
            "the launcher started separate programs (wrong PMI, or srun --mpi=none?)")


def _agree(failed: bool, detail: str = "") -> bool:
    """Max of `failed` over the world, or abort the job (showing `detail`) if the ranks are out of step."""
    send = numpy.array([int(failed)], dtype="i4")
    recv = numpy.zeros(1, dtype="i4")
    req = WORLD.Iallreduce(send, recv, op=MPI.MAX)
    deadline = time.monotonic() + SYNC_TIMEOUT
    while not req.Test():
        if time.monotonic() > deadline:
            sys.stderr.write(f"\n[rank {WORLD.Get_rank()}] other ranks did not finish this test within "
                             f"{SYNC_TIMEOUT:.0f} s (a rank failed while others wait in a collective?): "
                             f"aborting the MPI job\n{detail}\n")
            sys.stderr.flush()
            WORLD.Abort(1)
        time.sleep(0.001)
    return bool(recv[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if WORLD.Get_size() == 1 or report.when != "call":
        return
    detail = f"{item.nodeid} failed on rank {WORLD.Get_rank()}:\n{report.longreprtext}" if report.failed else ""
    if _agree(report.failed, detail) and not report.failed:
        report.outcome = "failed"
        report.longrepr = f"failed on another rank (rank {WORLD.Get_rank()} passed)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Record the topologies the test body creates, and free them (all ranks, same order) when it ends."""
    made, create = [], Topology.__dict__["create"]

    def recording(cls, *args, **kw):
        topo = create.__func__(cls, *args, **kw)
        made.append(topo)
        return topo

    Topology.create = classmethod(recording)
    try:
        yield
    finally:
        Topology.create = create
        for topo in made:
            topo.free()
        FREED[0] += len(made)


FREED = [0]


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)     # a pytest-xdist worker (tests/run.sh)
    if workeroutput is not None:
        workeroutput["topologies_freed"] = FREED[0]


@pytest.hookimpl(optionalhook=True)       # pytest-xdist's hook: the suite runs without it too
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: add up its workers' counts (the tests ran there)."""
    FREED[0] += getattr(node, "workeroutput", {}).get("topologies_freed", 0)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"topologies freed after their tests: {FREED[0]}")


@pytest.fixture
def world():
    return WORLD


@pytest.fixture(scope="module")
def serving_checkpoint(request, tmp_path_factory):
    """A checkpoint trained for 2 steps by a 2-rank job (tests/serving.py), one per test module that asks."""
    from serving import train_checkpoint
    return train_checkpoint(tmp_path_factory.mktemp(request.module.__name__))


@pytest.fixture(scope="module")
def serving_serial(serving_checkpoint):
    """serving_checkpoint's model on this process alone (float64): what each request gets alone."""
    from serving import serial_model
    return serial_model(serving_checkpoint)
