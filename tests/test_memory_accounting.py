"""Memory per rank measured (mpi_tp.core.memory): each category on a tiny model equals its closed form.

Psi parameters (tp 1: every rank holds the whole model), D = the world's data-parallel replicas, each
owner array counted once (a parameter's gradient is a view into a bucket: counted once, in gradients):

    parameters  Psi x itemsize                gradients  Psi x itemsize (+ ZeRO-1's averaged share)
    optimizer   AdamW: 2 x 4 x Psi, / D under ZeRO-1 (its share); + 4 x Psi fp32 masters at 16 bits
    activations at the loss's forward: what Module.activation_bytes counts after a forward, plus the logits

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_memory_accounting.py   (N = 1 .. 3)
"""
from types import SimpleNamespace

import numpy as np
import pytest

from mpi_tp.core import memory
from mpi_tp.core.memory import MemoryMeter
from mpi_tp.core.testing import all_true
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.pipeline.engine import PREPOST
from mpi_tp.parallel.pipeline.stage import as_stage
from mpi_tp.parallel.topology import Topology, split_sizes
from mpi_tp.training.optim import BLOCK, AdamW
from mpi_tp.training.step import train_step

pytestmark = pytest.mark.mpi(min_size=1)
L, C, H, S, V, B = 2, 16, 4, 8, 32, 2


def cfg(n_layer=L):
    return GPTConfig(vocab_size=V, block_size=S, n_layer=n_layer, n_head=H, n_embd=C)


def metered_step(world, zero, dtype="float32", recompute="none"):
    """One training step at tp 1, dp = the world, under a meter: its report, the model, reducer, optimizer,
    Psi (the parameters) and the topology."""
    topo = Topology.create(world, tp=1, dp=world.Get_size())
    model = GPT(cfg(), topo, dtype=dtype, recompute=recompute)
    reducer = GradReducer(model, topo.dp, distributed=bool(zero), stage=max(int(zero), 1))
    opt = AdamW(model.parameters(), reducer=reducer)
    x = np.arange(B * topo.dp.size * S).reshape(-1, S) % V
    meter = MemoryMeter(as_stage(model, 1), opt, reducer)
    with meter:
        train_step(model, opt, x, x, topo.replica_rows(B), 1, reducer=reducer)
    psi = sum(int(np.prod(p.global_shape)) for p in model.parameters())
    return SimpleNamespace(rep=meter.report(), model=model, reducer=reducer, opt=opt, psi=psi, topo=topo)


@pytest.mark.parametrize("zero", [False, True])
def test_model_state_categories_equal_their_closed_forms(world, zero):
    run = metered_step(world, zero)
    rep, reducer, opt, psi, topo = run.rep, run.reducer, run.opt, run.psi, run.topo
    D, r = topo.dp.size, topo.dp.rank
    share = sum(split_sizes(b.grads.size, D)[r] for b in reducer.buckets) if zero and D > 1 else psi
    assert sum(b.grads.size for b in reducer.buckets) in (0, psi)
    expect = {"parameters": 4 * psi,                                  # the buckets' params are the Params' data
              "gradients": 4 * psi + (4 * share if zero and D > 1 else 0),
              "optimizer": 2 * 4 * share,                             # m and v of this rank's share
              "workspace": 2 * 4 * min(BLOCK, max(s.size for s in opt.spaces))}
    got = {k: rep["max"][k] for k in expect}
    assert all_true(got == expect, world), (got, expect)
    topo.free()


def test_zero2_holds_the_whole_gradients_only_during_the_backward(world):
    """ZeRO-2: at the loss's forward (the step's peak) and after the update the gradients are the shares
    alone, ZeRO-1's whole buffers gone; the peak falls by them (1 rank: nothing to share, as ZeRO-1)."""
    one, two = metered_step(world, 1), metered_step(world, 2)
    D = one.topo.dp.size
    whole = 4 * one.psi                                                # ZeRO-1's whole buffers, float32
    share = one.rep["peak"]["gradients"] - whole if D > 1 else 0
    if D > 1:
        ok = (two.rep["peak"]["gradients"] == share and two.rep["peak"]["total"] == one.rep["peak"]["total"] - whole
              and two.rep["max"]["gradients"] > share)             # the whole buffers exist in the backward
    else:
        ok = two.rep["peak"] == one.rep["peak"]
    assert all_true(ok, world), (one.rep["peak"], two.rep["peak"], two.rep["max"])
    one.topo.free()
    two.topo.free()


def test_activations_at_the_loss_are_the_caches_and_the_logits(world):
    """The peak of a step without recomputation is the loss's forward: every cache a forward leaves
    (Module.activation_bytes) and the logits beside their softmax (B S V values)."""
    run = metered_step(world, False)
    rep, model, topo = run.rep, run.model, run.topo
    x = np.arange(B * S).reshape(B, S) % V
    model.forward(x, x)
    expect = model.activation_bytes() + B * S * V * 4
    model.backward()
    ok = rep["peak_at"] == "loss" and rep["peak"]["activations"] == expect and rep["peak"]["communication"] == 0
    assert all_true(ok, world), (rep["peak_at"], rep["peak"]["activations"], expect)
    topo.free()


def test_bf16_keeps_two_byte_weights_and_fp32_masters_and_moments(world):
    run = metered_step(world, False, dtype="bfloat16")
    rep, psi, topo = run.rep, run.psi, run.topo
    expect = {"parameters": 2 * psi, "gradients": 2 * psi, "optimizer": (4 + 4 + 4) * psi}
    got = {k: rep["max"][k] for k in expect}
    assert all_true(got == expect, world), (got, expect)
    topo.free()


def test_full_recomputation_peaks_inside_a_blocks_backward(world):
    """Full recomputation keeps each block's input only; the step's peak is then inside a backward, when
    one block's caches are rebuilt (the 'recompute' probe), and it is below the peak without it."""
    full = metered_step(world, False, recompute="full")
    full.topo.free()
    none = metered_step(world, False)
    none.topo.free()
    full, none = full.rep, none.rep
    samples = full["samples"] == none["samples"] + L                 # one sample per block's recomputation
    ok = samples and full["peak"]["activations"] < none["peak"]["activations"]
    assert all_true(ok, world), (full, none)


def test_a_stage_counts_its_micro_batches_caches_and_its_messages(world):
    """1F1B on stage 0 of P: the caches of min(P, M) micro-batches at once (the stage's own count,
    PipelineStage.peak_activation_bytes), and the engine's posted receives and sends in flight, whole
    messages of B S C values."""
    P = world.Get_size()
    if P < 2:
        pytest.skip("one stage: no pipeline")
    topo = Topology.create(world, tp=1, pp=P, dp=1)
    M = 4
    stage = build_stage(cfg(n_layer=2 * P), topo, "float32", 0, False, "1f1b", M)
    stage.count_activations = True
    opt = AdamW(stage.parameters())
    meter = MemoryMeter(stage, opt)
    x = np.arange(B * M * S).reshape(-1, S) % V
    with meter:
        train_step(stage, opt, x, x, slice(0, B * M))
    rep, message = meter.report(), B * S * C * 4
    comm = rep["max"]["communication"]
    ok = comm % message == 0 and message <= comm <= (PREPOST + 1 + M) * message
    if topo.pp.rank == 0:        # no loss here: the peak is the caches of the micro-batches in flight
        ok = ok and rep["max"]["activations"] == stage.peak_activation_bytes
    assert all_true(ok, world), (topo.pp.rank, rep, stage.peak_activation_bytes)
    topo.free()


def test_a_probe_with_no_meter_entered_samples_nothing():
    meter = MemoryMeter(as_stage(GPT(cfg()), 1))
    memory.probe("F")
    with meter:
        memory.probe("F")
    memory.probe("F")
    assert meter.samples == 1 and memory._meters == []


def test_on_cupy_the_memory_pool_is_read_at_the_same_points(world):
    """--backend cupy: the report carries the memory pool's peak (cupy.get_default_memory_pool()), which
    holds at least the arrays the accounting saw; the CuPy stand-in keeps no pool (0 bytes)."""
    import os

    from mpi_tp.core import backend
    standin = os.environ.get("MPI_TP_CUPY_STANDIN") == "1"
    if not standin:
        cupy = pytest.importorskip("cupy")
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no GPU (MPI_TP_CUPY_STANDIN=1 runs this on the stand-in)")
    backend.use("cupy", world)
    try:
        run = metered_step(world, False)
        run.topo.free()
    finally:
        backend.use("numpy")
    device, peak = run.rep["device"], run.rep["peak"]["total"]
    ok = device == {"used": 0, "total": 0} if standin else device["used"] >= peak > 0
    assert all_true(ok, world), (device, peak)
