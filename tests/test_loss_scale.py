"""fp16 training's dynamic loss scaling (mpi_tp.training.loss_scale): the rule, a forced overflow on one
rank skipped on every rank, a resume that keeps the scale, and one line for bad options.

The overflow test compares two fp16 runs of the same layout. Run A has the failpoint `overflow:2`: after
step 2's backward pass only the world's last rank writes inf into one of its gradients (the others'
gradients are finite, and with plain data parallelism they never see that rank's). Run B has no
failpoint; its step 2 runs the forward and backward passes (the dropout masks advance as in A) and no
update, and its loss scale is set by hand to the one A should have at each step. A must skip step 2 on
every rank, halve its scale, and then equal B bit for bit: a rank that applied step 2's update, or
that used another scale afterwards, would make the parameters differ.
"""
import json
import math
import os

import numpy as np
import pytest
from mpi4py import MPI

from mpi_tp.core.testing import all_true
from mpi_tp.model.config import ConfigError
from mpi_tp.training.build import build
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.loop import run_step, train
from mpi_tp.training.loss_scale import LossScaler, Overflow
from mpi_tp.training.step import forward_backward

WORLD = MPI.COMM_WORLD
BASE = dict(n_layer=2, n_head=4, n_embd=16, block_size=8, batch_size=2, steps=4, sample_len=0, warmup=0, lr=1e-2,
            bucket_mb=0.001, eval_batches=1, dropout=0.1, precision="fp16", min_lr_ratio=1.0,
            initial_loss_scale=2.0 ** 12, loss_scale_window=1000)
LAYOUTS = {1: {"serial": {}},
           2: {"tp2": dict(tp=2), "dp2": dict(dp=2), "pp2": dict(pp=2, micro_batches=2)},
           3: {"tp3": dict(tp=3, n_head=3, n_embd=12)},
           4: {"tp2-dp2-zero1": dict(tp=2, dp=2, zero=1), "pp2-dp2": dict(pp=2, dp=2, micro_batches=2)},
           }.get(WORLD.Get_size(), {})
pytestmark = pytest.mark.mpi(min_size=1)


def test_the_scale_backs_off_grows_after_a_window_and_stops_at_the_floor():
    s = LossScaler(initial=8.0, window=2, backoff=0.5, floor=2.0)
    seen = []
    for norm in [1.0, 1.0, 1.0, float("inf"), 1.0, float("nan"), float("inf"), float("inf")]:
        problem = s.check(norm, MPI.COMM_SELF)
        seen.append((s.scale, type(problem).__name__))
    assert seen == [(8, "NoneType"), (16, "NoneType"), (16, "NoneType"), (8, "Overflow"), (8, "NoneType"),
                    (4, "Overflow"), (2, "Overflow"), (2, "str")]         # at the floor: a divergence
    assert s.overflows == 3
    again = LossScaler(initial=8.0, window=2, backoff=0.5, floor=2.0)
    again.restore(json.loads(json.dumps(s.state())))                      # as a checkpoint's metadata keeps it
    assert (again.scale, again.good, again.overflows) == (s.scale, s.good, s.overflows)


@pytest.fixture
def out(tmp_path, world):
    return world.bcast(str(tmp_path) if world.Get_rank() == 0 else None)


def params(run):
    return [p.data.copy() for p in run.model.parameters()]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_an_overflow_on_one_rank_is_skipped_on_every_rank(out, name, monkeypatch):
    layout = LAYOUTS[name]
    monkeypatch.setenv("MPI_TP_FAILPOINT", "overflow:2")
    a = build(TrainConfig(**{**BASE, **layout}, out=os.path.join(out, name + "-a")), WORLD)
    try:
        assert a.model.dtype.name == "float16"
        a.topo.stats.reset()
        steps = [run_step(a, step, a.cfg.lr) for step in range(1, 5)]
        got, scale = params(a), a.scaler.scale
        flags = a.topo.stats.calls.get("world/loss_scale_flag", 0)      # the check's all-reduce, counted
    finally:
        a.close()
    monkeypatch.delenv("MPI_TP_FAILPOINT")
    problems = [p for _, _, p in steps]
    # decided on every rank together: a rank that alone failed here would leave the others hanging in build
    skipped = problems[0] is None and problems[2:] == [None, None] and isinstance(problems[1], Overflow)
    counted = flags == (4 if WORLD.Get_size() > 1 else 0)     # one rank communicates (and counts) nothing
    assert all_true(skipped and scale == 2.0 ** 11 and counted, WORLD), (problems, scale, flags)

    b = build(TrainConfig(**{**BASE, **layout}, out=os.path.join(out, name + "-b")), WORLD)
    try:
        for step, scale in [(1, 2.0 ** 12), (2, None), (3, 2.0 ** 11), (4, 2.0 ** 11)]:
            if scale is None:                   # step 2: the passes, no update
                x, y = b.sampler.batch(step - 1)
                forward_backward(b.model, x, y, b.rows, b.cfg.micro_batches, b.reducer, None, b.scaler.scale)
                continue
            b.scaler.scale = scale
            assert run_step(b, step, b.cfg.lr)[2] is None
        want = params(b)
    finally:
        b.close()
    assert all_true(all(np.array_equal(g, w) for g, w in zip(got, want)), WORLD), "A differs from B"


def test_the_loss_scale_is_undone_before_the_moments(out):
    """The backward is seeded with the scale S and the update divides it out again: after one step at
    S = 2^12, AdamW's first moment m = (1 - b1) g is the unscaled gradient's, as at S = 1 (to fp16's
    rounding of the gradients, far from a factor S either way). Adam's update itself barely depends on
    a constant factor in g, so the weights alone would not show a scale left in or applied twice."""
    layout = next(iter(LAYOUTS.values()))
    sizes = {}
    for scale in (2.0 ** 12, 1.0):
        run = build(TrainConfig(**{**BASE, **layout, "initial_loss_scale": scale}, out=os.path.join(out, f"s{scale:g}")),
                    WORLD)
        try:
            assert run_step(run, 1, run.cfg.lr)[2] is None and run.scaler.scale == scale
            m = run.opt.state_tensors()["m"]
            sizes[scale] = math.sqrt(WORLD.allreduce(sum(float((a.astype(np.float64) ** 2).sum()) for a in m)))
        finally:
            run.close()
    assert sizes[1.0] > 0 and abs(sizes[2.0 ** 12] / sizes[1.0] - 1) < 0.05, sizes


def test_a_resumed_fp16_run_keeps_its_scale(out, monkeypatch):
    layout = next(iter(LAYOUTS.values()))
    monkeypatch.setenv("MPI_TP_FAILPOINT", "overflow:3")
    cfg = dict(BASE, **layout, loss_scale_window=2)
    straight = train(TrainConfig(**cfg, out=os.path.join(out, "straight")), WORLD)
    train(TrainConfig(**{**cfg, "steps": 2}, out=os.path.join(out, "resumed")), WORLD)      # saves step 2
    resumed = train(TrainConfig(**cfg, out=os.path.join(out, "resumed"), resume=True), WORLD)
    assert straight["loss_scale"] == resumed["loss_scale"]
    assert straight["loss_scale"]["overflows"] == 1 and straight["loss_scale"]["scale"] == 2.0 ** 12
    assert straight["final_val_loss"] == resumed["final_val_loss"]          # the same weights at the end
    if WORLD.Get_rank() == 0:
        with open(os.path.join(out, "resumed", "metrics.jsonl")) as f:
            skipped = [e for e in map(json.loads, f) if "skipped" in e]
        assert [(e["step"], e["loss_scale"]) for e in skipped] == [(3, 2.0 ** 12)]


@pytest.mark.parametrize("options,says", [
    (dict(precision="bf16", initial_loss_scale=1024.0), "--initial-loss-scale: loss scaling is for --precision fp16"),
    (dict(loss_scale_backoff=1.5), "the backoff must be between 0 and 1"),
    (dict(initial_loss_scale=0.5), "the initial scale 0.5 is below the floor 1"),
    (dict(min_loss_scale=0.0, loss_scale_window=-1), "the floor must be > 0 .*; the growth window must be >= 0")])
def test_bad_loss_scale_options_are_one_line(options, says):
    with pytest.raises(ConfigError, match=says) as e:
        TrainConfig(**{**BASE, **options}).validate(1)
    assert "\n" not in str(e.value)
