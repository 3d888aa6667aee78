"""Training at --precision bf16 and fp16: every layout against the serial run in the same format and the
fp32 run, a resume that is bitwise, and one line for what 16 bits do not run with yet.

Why a tolerance and which. The layouts cut the same sums differently: a row-parallel layer's partial
sums are rounded to bf16 on each rank and summed by a bf16 all-reduce (as Megatron's are), where the
serial layer sums everything in fp32 and rounds once; a data-parallel replica's gradients are averaged
in bf16. Each such rounding moves a value by at most u = 2^-8 of itself; the loss of these tiny models
over 3 AdamW steps moved by at most 2.7e-4 of itself against the serial bf16 run on the same global batch,
and by at most 4.4e-4 against the same layout in fp32 (1 to 4 ranks, AMD EPYC, 2026-12-04): allowed
2^-8 (0.39%, one bf16 ulp of the loss). fp16 rounds 8 times finer (u = 2^-11): at most 4.3e-5 against
the serial fp16 run and 3.5e-5 against fp32 were measured, 2^-11 (one fp16 ulp) is allowed; its loss
scale (mpi_tp.training.loss_scale) is a power of two, so it moves no bits while nothing overflows or
underflows. Longer runs drift further apart, as any two roundings do (the
README model after 30 steps at 2 ranks: validation 2.9566 at bf16, 2.9842 at fp32). The same layout and
the same steps give the same bits: a resumed run equals the straight one exactly.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from mpi_tp.model.config import ConfigError
from mpi_tp.training.build import build
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.loop import run_step, train

WORLD = MPI.COMM_WORLD
ULP = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}      # one unit in the last place of a value near 1, relative
BASE = dict(n_layer=2, n_head=5, n_embd=20, block_size=8, batch_size=2, steps=3, sample_len=0, warmup=0, lr=1e-2,
            bucket_mb=0.001, eval_batches=1, dropout=0.1, precision="bf16", min_lr_ratio=1.0)   # a constant lr
LAYOUTS = {1: {"serial": {}, "llama": dict(arch="llama", n_kv_head=1)},
           2: {"tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True), "dp2-zero1": dict(dp=2, zero=1),
               "pp2": dict(pp=2, micro_batches=2), "llama-tp2": dict(tp=2, arch="llama", n_kv_head=1)},
           3: {"tp3": dict(tp=3)},
           4: {"tp2-dp2": dict(tp=2, dp=2), "tp2-pp2-sp": dict(tp=2, pp=2, micro_batches=2, sequence_parallel=True)},
           }.get(WORLD.Get_size(), {})
pytestmark = pytest.mark.mpi(min_size=1)


@pytest.fixture
def out(tmp_path, world):
    return world.bcast(str(tmp_path) if world.Get_rank() == 0 else None)


def losses(where, name, steps=3, comm=WORLD, **options):
    """The losses of steps run.first .. steps of `mpi-tp train` at these options (in --out where/name)."""
    cfg = TrainConfig(**{**BASE, **options}, out=os.path.join(where, name))
    run = build(cfg, comm)
    try:
        assert run.model.dtype.name == {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.precision]
        return np.array([run_step(run, step, cfg.lr)[0] for step in range(run.first, steps + 1)])
    finally:
        run.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_at_16_bits_is_near_the_serial_and_the_fp32_runs(out, name, precision):
    layout = {**LAYOUTS[name], "precision": precision}
    same = {k: v for k, v in layout.items() if k in ("arch", "n_kv_head", "precision")}   # the serial run: one
    same["batch_size"] = BASE["batch_size"] * layout.get("dp", 1) * layout.get("micro_batches", 1)   # rank, the batch
    got = losses(out, name, **layout)
    serial = WORLD.bcast(losses(out, "serial", comm=MPI.COMM_SELF, **same) if WORLD.Get_rank() == 0 else None)
    wide = losses(out, name + "-fp32", **{**layout, "precision": "fp32"})
    ulp = ULP[precision]
    assert np.all(np.abs(got - serial) <= ulp * serial), (got, serial)
    assert np.all(np.abs(got - wide) <= ulp * wide), (got, wide)


def test_a_resumed_bf16_run_is_bitwise_the_straight_one(out):
    layout = next(iter(LAYOUTS.values()))
    straight = losses(out, "straight", steps=4, **layout)
    train(TrainConfig(**{**BASE, **layout, "steps": 2}, out=os.path.join(out, "resumed")), WORLD)   # saves step 2
    rest = losses(out, "resumed", steps=4, resume=True, **layout)                              # steps 3 and 4
    assert np.array_equal(rest, straight[2:]), (rest, straight)


@pytest.mark.parametrize("options,says", [(dict(dtype="float64"), "--dtype float64"), (dict(backend="cupy"), "cupy"),
                                          (dict(precision="fp8"), "choose one of fp32, bf16, fp16")])
def test_what_bf16_does_not_run_with_yet_is_one_line(options, says):
    with pytest.raises(ConfigError, match=says) as e:
        TrainConfig(**{**BASE, "block_size": 16, **options}).validate(2 if options.get("cp") else 1)
    assert "\n" not in str(e.value)


def test_fp32_grads_accumulate_and_reduce_in_fp32(out):
    """--fp32-grads: every gradient fp32, the data-parallel messages twice the bytes of the 16-bit ones,
    the losses as near the serial run as the 16-bit gradients' (they round less, not more)."""
    layout = {2: dict(dp=2), 4: dict(tp=2, dp=2, zero=1)}.get(WORLD.Get_size())
    if layout is None:
        pytest.skip("a data-parallel layout: 2 or 4 ranks")
    dp_bytes = {}
    for wide_grads in (False, True):
        cfg = TrainConfig(**{**BASE, **layout, "fp32_grads": wide_grads}, out=os.path.join(out, f"g{wide_grads}"))
        run = build(cfg, WORLD)
        try:
            assert {p.grad.dtype.name for p in run.model.parameters()} == {"float32" if wide_grads else "bfloat16"}
            got = np.array([run_step(run, step, cfg.lr)[0] for step in range(1, 4)])
            sent = run.topo.stats.snapshot()         # the gradients' reductions, less the loss's float64 a step
            dp_bytes[wide_grads] = sum(v["bytes"] for k, v in sent.items() if k.startswith("dp/") and "reduce" in k) - 8 * 3
        finally:
            run.close()
    assert dp_bytes[True] == 2 * dp_bytes[False] > 0, dp_bytes
    same = {"batch_size": BASE["batch_size"] * 2, "fp32_grads": True}
    serial = WORLD.bcast(losses(out, "serial", comm=MPI.COMM_SELF, **same) if WORLD.Get_rank() == 0 else None)
    assert np.all(np.abs(got - serial) <= ULP["bf16"] * serial), (got, serial)
