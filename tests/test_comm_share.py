"""What `mpi-tp train` counts as communication: the seconds a rank was held in it (never more than the
step's time, in every layout the train tests run), and run.json's counters by phase (a step's traffic apart
from evaluation's, checkpoints' and setup's).

    python -m pytest -q --with-mpi tests/test_comm_share.py                        (the jobs: 2 ranks each)
    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_comm_share.py   (N = 2 .. 4)
"""
import functools
import json
import time

import numpy as np
import pytest
from jobs import MPIEXEC, mpirun

from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.comm_stats import CommStats

cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
COMMON = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--sample-len", "0",
          "--log-every", "1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2"]
LAYOUTS = {     # 2 ranks each: every parallel dimension the train tests run
    "tp2": ["--tp", "2"],
    "pp2-1f1b": ["--pp", "2", "--micro-batches", "4", "--schedule", "1f1b"],
    "pp2-gpipe": ["--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"],
    "pp2-interleaved": ["--pp", "2", "--micro-batches", "4", "--schedule", "interleaved", "--virtual-stages", "2",
                        "--n-layer", "4"],
    "cp2": ["--cp", "2"],
    "dp2-zero1": ["--dp", "2", "--zero", "1"],
    "moe-dp2-ep2": ["--dp", "2", "--ep", "2", "--moe-experts", "2"],
}
STEPS = 4
PHASES = {"train_steps", "evaluation", "checkpoints", "other"}


@functools.cache
def _trained(layout: str, steps: int, root: str) -> tuple[list[dict], dict]:
    out = f"{root}/{layout}-{steps}"
    r = mpirun(2, "train", *COMMON, *LAYOUTS[layout], "--steps", str(steps), "--out", out)
    assert r.returncode == 0, r.stderr
    with open(f"{out}/metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    with open(f"{out}/run.json") as f:
        return [line for line in lines if "comm_s" in line], json.load(f)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    return lambda layout, steps=STEPS: _trained(layout, steps, root)


@cli
@pytest.mark.launcher
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_comm_seconds_of_a_step_are_at_most_the_step(trained, layout):
    """Every logged step (--log-every 1): comm_s, the seconds rank 0 was held in communication, is at most
    step_s, its wall time (before, a pipeline's sends and receives counted their whole flight, overlapping
    each other and the computation: 140-250% at pp 2, 180-270% at cp 2). And some communication was
    counted."""
    steps, run = trained(layout)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert s["comm_s"] <= s["step_s"], (layout, s)
    assert sum(s["comm_s"] for s in steps) > 0, layout
    counted = sum(v["seconds"] for phase in ("train_steps", "evaluation", "checkpoints")   # setup's ("other")
                  for v in run["communication"][phase].values())                            # came before
    assert counted <= run["train_seconds"], (counted, run["train_seconds"])


@cli
@pytest.mark.launcher
@pytest.mark.parametrize("layout", ["tp2", "dp2-zero1", "pp2-1f1b"])
def test_run_json_keeps_the_steps_traffic_apart(trained, layout):
    """run.json's communication by phase: the training steps' calls and bytes of a 4-step run are 4 times a
    1-step run's (dense: every step moves the same); evaluations (every 2 steps) and checkpoint saves (every
    2 steps, the last step's included) land in their own parts, twice as many in 4 steps as in 2; setup's
    and the log lines' ("other") the same in every run."""
    runs = {n: trained(layout, n)[1]["communication"] for n in (1, 2, STEPS)}
    run = runs[STEPS]
    assert set(run) == PHASES | {"steps_run"}
    assert [runs[n]["steps_run"] for n in (1, 2, STEPS)] == [1, 2, STEPS]

    def counts(c, phase, times=1):
        return {k: (times * v["calls"], times * v["bytes"], times * v["wire_bytes"]) for k, v in c[phase].items()}
    assert counts(run, "train_steps") == counts(runs[1], "train_steps", STEPS)
    for phase in ("evaluation", "checkpoints"):
        assert counts(run, phase) == counts(runs[2], phase, 2), phase
    assert counts(run, "other") == counts(runs[2], "other") == counts(runs[1], "other")
    assert counts(run, "train_steps"), "no step traffic counted"
    if layout == "dp2-zero1":
        # ZeRO-1's checkpoint gathers every rank's optimizer share: in "checkpoints", not in the steps
        assert counts(run, "checkpoints")["dp/all_gather"][0] > 0
        # the gradient norm's squares over dp: four float64 sums (docs/parallelism.md), 32 bytes a step
        calls, nbytes, _ = counts(run, "train_steps")["dp/grad_norm"]
        assert (calls, nbytes) == (STEPS, 32 * STEPS)


@pytest.mark.mpi(min_size=2)
def test_a_receive_counts_its_wait_not_its_flight(world):
    """Rank 1 posts a receive, computes (sleeps) while the message arrives, then waits: the seconds counted
    are at most the time outside the sleep (before: the whole flight, the sleep included). A wait inside
    another (ring attention's ring_wait) is counted once, by the outer one."""
    g = Group(world.Dup(), "t", CommStats())
    x = np.zeros(8)
    if g.rank == 0:
        g.isend(np.ones(8), dest=1, tag=5).wait()
        with g.stats.blocked("t/outer"):
            g.isend(np.ones(8), dest=1, tag=6).wait()
    elif g.rank == 1:
        t0 = time.perf_counter()
        pending = g.irecv(x, source=0, tag=5)
        slept = time.perf_counter()
        time.sleep(0.2)
        slept = time.perf_counter() - slept
        pending.wait()
        wall = time.perf_counter() - t0
        assert x.sum() == 8
        assert g.stats.seconds["t/recv"] <= wall - slept, (g.stats.seconds["t/recv"], wall, slept)
        before = g.stats.seconds["t/recv"]
        t0 = time.perf_counter()
        with g.stats.blocked("t/outer"):
            g.irecv(x, source=0, tag=6).wait()
        wall = time.perf_counter() - t0
        assert g.stats.calls["t/recv"] == 2                      # counted as a call ...
        assert g.stats.seconds["t/recv"] == before               # ... whose time the outer wait holds
        assert 0 < g.stats.seconds["t/outer"] <= wall
    g.comm.Barrier()
