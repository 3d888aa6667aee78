"""--precision bf16 over the parts test_precision_train does not reach: ring attention (cp), the mixture of
experts (ep, with tp, dp and pp), and float16 on the CuPy stand-in.

    python -m pytest -q --with-mpi tests/test_precision_layouts.py
    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_precision_layouts.py   (N = 1 .. 4)

The bounds, with u = 2^-8 (bf16's unit roundoff):
- Ring attention's output and dq are the fp32 ring's on the widened q, k, v (and dout, and the stored
  bf16 output that D = rowsum(dout * out) reads) rounded once: bit for bit. The K/V blocks travel in
  bf16 and are widened exactly; every score, statistic and sum is the fp32 ring's arithmetic in its order.
- Its dk and dv: the partial sums travel in bf16, rounded once per hop. With c_j rank j's queries'
  contribution, every partial sum is at most sum_j |c_j| in size, so after Z hops |dk - dk_fp32| <=
  Z u sum_j |c_j| (allowed with 1% and fp32's 2^-20 on top: the two sides' fp32 additions differ too).
- The MoE router: its logits, probabilities, choices, gates, aux and z-losses are the fp32 layer's on
  the widened weights and input, bit for bit (nothing of the router is rounded to bf16). The layer's
  output and gradients pass through at most 6 roundings of bf16 (the experts' GEMMs and GELU, the
  combine, the all-reduce); the GEMMs' sums of |terms| stay within 2x of their results at these sizes:
  allowed 12 u times the largest value of each.
- A loss scale (GPT.backward's dout, which the MoE blocks' aux and z-losses follow) of 1/2 gives exactly
  half of every bf16 gradient: scaling by a power of two commutes with every rounding (bf16 has fp32's
  range: nothing here is near a subnormal).
- Every layout's losses over 3 AdamW steps within 2^-8 of the serial bf16 run on the same global batch and
  of the same layout in fp32 (tests/test_precision_train.py says why that bound: each layout rounds its
  partial sums elsewhere); measured at most 2.9e-4 and 5.6e-4 (2-4 ranks, AMD EPYC, 2026-12-04).
- float16 on the CuPy stand-in: the NumPy path's bits (the stand-in computes with NumPy).
"""
import os

import numpy as np
import pytest
from mpi4py import MPI
from test_context_parallel import ring_case
from test_moe import moved_rows
from test_precision_train import BASE

from mpi_tp.core import backend, blas
from mpi_tp.core import kernels as kern
from mpi_tp.core.errors import UserError
from mpi_tp.core.precision import bfloat16, narrow, widen
from mpi_tp.core.testing import all_true
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.ring_attention import ring_backward, ring_forward
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.build import build
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.loop import run_step, train

WORLD = MPI.COMM_WORLD
U = 2.0 ** -8
BF16 = bfloat16()
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_aux_weight": 0.05, "moe_z_weight": 0.01}
LLAMA = {"arch": "llama", "n_kv_head": 1}
TINY = {"vocab_size": 37, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 16, "dropout": 0.0}
LAYOUTS = {2: {"cp2": {"cp": 2}, "llama-gqa-cp2": {"cp": 2, **LLAMA}, "moe-dp2-ep2": {"dp": 2, "ep": 2, **MOE},
               "moe-pp2": {"pp": 2, "micro_batches": 2, **MOE}},
           3: {"cp3": {"cp": 3}, "moe-dp3-ep3": {"dp": 3, "ep": 3, **MOE}},
           4: {"cp2-tp2-sp": {"cp": 2, "tp": 2, "sequence_parallel": True},
               "moe-tp2-dp2-ep2": {"tp": 2, "dp": 2, "ep": 2, **MOE},
               "moe-pp2-dp2-ep2": {"pp": 2, "dp": 2, "ep": 2, "micro_batches": 2, **MOE}},
           }.get(WORLD.Get_size(), {})


def whole(shape, seed, dtype=BF16):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- ring attention's kernels at bf16

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("grouped, dropout", [(False, False), (True, True)], ids=["mha", "gqa-dropout"])
def test_ring_attention_at_bf16_is_the_fp32_ring_rounded_once(world, grouped, dropout):
    n = world.Get_size()
    topo, split, (q, k, v, dout), mask, mine = ring_case(world, grouped, dropout, BF16)
    pos = split.positions

    def mask_of(src, rows, cols):
        return mask[..., pos[rows], :][..., split.positions_of(src)[cols]]
    mo = mask_of if dropout else None
    topo.stats.reset()
    out32, c32 = ring_forward(*(widen(mine(a)) for a in (q, k, v)), split, mo, 1.4)
    ring_backward(widen(mine(dout)), c32)
    wide_sends = topo.stats.snapshot().get("cp/send")
    topo.stats.reset()
    out, cache = ring_forward(mine(q), mine(k), mine(v), split, mo, 1.4)
    got = ring_backward(mine(dout), cache)
    sends = topo.stats.snapshot().get("cp/send")
    ref = ring_backward(widen(mine(dout)), c32[:3] + (widen(out),) + c32[4:])     # D from the stored bf16 out

    ok = out.dtype == BF16 and all(g.dtype == BF16 for g in got)
    ok &= np.array_equal(out, narrow(out32, BF16)) and np.array_equal(got[0], narrow(ref[0], BF16))
    # each rank's queries' contribution to dk and dv, from the serial kernel in float64
    q64, k64, v64, d64 = (widen(a).astype("float64") for a in (q, k, v, dout))
    _, c64 = kern.attention_forward(q64, k64, v64, mask, 1.4)
    sums = [0.0, 0.0]
    for j in range(n):
        rows = split.positions_of(j)
        dout_j = np.zeros_like(d64)
        dout_j[..., rows, :] = d64[..., rows, :]
        for i, c in enumerate(kern.attention_backward(dout_j, c64)[1:]):
            sums[i] = sums[i] + np.abs(mine(c))
    for g, r, total in zip(got[1:], ref[1:], sums):
        if n == 1:
            ok &= np.array_equal(g, narrow(r, BF16))
        else:
            ok &= bool(np.all(np.abs(widen(g) - r) <= (1.01 * n * U + 2.0 ** -20) * total))
    # the ring ran and carried 2 bytes a value: the fp32 ring's messages at half the bytes
    ok &= (sends is None and wide_sends is None and n == 1) or (
        sends["calls"] == wide_sends["calls"] == 3 * n - 2 and 2 * sends["bytes"] == wide_sends["bytes"])
    assert all_true(ok, world), f"bf16 ring attention at cp={n}: messages {sends} (fp32: {wide_sends})"
    topo.free()


# ---------------------------------------------------------------- the MoE layer at bf16

def moe_pair(**extra):
    """A bf16 MoE GPT and the fp32 GPT holding its widened weights (seed 3, one rank)."""
    cfg = GPTConfig(**{**TINY, **MOE, **extra})
    half = GPT(cfg, Topology.serial(), dtype="bfloat16", seed=3)
    wide = GPT(cfg, Topology.serial(), dtype="float32", seed=3)
    for p, w in zip(half.parameters(), wide.parameters()):
        w.data[...] = widen(p.data)
    return half, wide


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_router_runs_in_fp32_and_the_experts_in_bf16(arch):
    half, wide = moe_pair(**(LLAMA if arch == "llama" else {}))
    h, w = half.moe_layers()[0], wide.moe_layers()[0]
    x, dout = whole((3, 8, 16), 6), whole((3, 8, 16), 7)
    y, y32 = h.forward(x), w.forward(widen(x))
    assert y.dtype == BF16 and all(p.data.dtype == BF16 for p in h.parameters())
    for a, b in zip(h.routing, w.routing):
        assert np.array_equal(a, b), "the choices or admissions differ from the fp32 router's"
    assert (h.stats["aux_loss"], h.stats["z_loss"]) == (w.stats["aux_loss"], w.stats["z_loss"])
    assert np.array_equal(h.stats["tokens_per_expert"], w.stats["tokens_per_expert"])
    dx, dx32 = h.backward(dout), w.backward(widen(dout))
    assert dx.dtype == BF16
    for name, a, b in [("y", y, y32), ("dx", dx, dx32)] + [(p.name, p.grad, q.grad) for p, q in
                                                           zip(h.parameters(), w.parameters())]:
        err = np.abs(widen(a) - b).max()
        assert err <= 12 * U * np.abs(b).max(), f"{name}: {err} against max |fp32| {np.abs(b).max()}"


def test_the_loss_scale_reaches_the_router_losses_at_bf16():
    """GPT.backward(dout) sets MoEMLP.loss_scale; at dout = 1/2 every bf16 gradient is exactly half."""
    model, _ = moe_pair(n_layer=2, moe_every=1)
    x, y = (np.random.default_rng(8).integers(0, 37, (2, 8)) for _ in range(2))
    grads = []
    for dout in (1.0, 0.5):
        model.zero_grad()
        model.forward(x, y, model.new_pass(8, step=0))
        model.backward(dout)
        grads.append([widen(p.grad) for p in model.parameters()])
    assert all(np.array_equal(a, 2 * b) for a, b in zip(*grads))
    assert any(np.any(g != 0) for g in grads[0][-2:])                      # the router's gradient is there


@pytest.mark.mpi(min_size=2)
def test_the_experts_all_to_all_carries_bf16_rows(world):
    """Per MoE layer 4 Alltoallv of rows (2 forward, 2 backward): rows leaving the rank x C x 2 bytes."""
    n = world.Get_size()
    cfg = GPTConfig(**{**TINY, "n_layer": 2}, **MOE)
    topo = Topology.create(world, tp=1, dp=n, ep=n)
    model = GPT(cfg, topo, dtype="bfloat16", seed=3)
    x, y = (np.random.default_rng([9, i]).integers(0, 37, (2 * n, 8)) for i in range(2))
    mine = topo.replica_rows(2)
    topo.stats.reset()
    model.forward(x[mine], y[mine])
    model.backward()
    v = topo.stats.snapshot()["ep/all_to_allv"]
    rows = sum(sent + got for sent, got in moved_rows(model, topo))
    ok = v["calls"] == 4 * len(model.moe_layers()) and v["bytes"] == 2 * rows * cfg.n_embd * 2
    assert all_true(ok, world), f"ep all-to-all at bf16: {v}, {rows} rows moved"
    topo.free()


# ---------------------------------------------------------------- every layout at bf16 against serial

@pytest.fixture
def out(tmp_path, world):
    return world.bcast(str(tmp_path) if world.Get_rank() == 0 else None)


def trained(where, name, comm=WORLD, **options):
    """(losses of 3 steps, the communication counters, the model's MoE stats) of `mpi-tp train`."""
    cfg = TrainConfig(**{**BASE, **options}, out=os.path.join(where, name))
    run = build(cfg, comm)
    try:
        assert all(p.data.dtype.name == cfg.model_dtype for p in run.model.parameters())
        losses = np.array([run_step(run, step, cfg.lr)[0] for step in range(run.first, 4)])
        return losses, run.topo.stats.snapshot(), [m.stats for m in run.model.moe_layers()]
    finally:
        run.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_cp_and_ep_layout_at_bf16_is_near_the_serial_run(out, name):
    layout = LAYOUTS[name]
    same = {k: v for k, v in layout.items() if k in ("arch", "n_kv_head") or k.startswith("moe_")}
    same["batch_size"] = BASE["batch_size"] * layout.get("dp", 1) * layout.get("micro_batches", 1)
    got, counters, moe = trained(out, name, **layout)
    serial = WORLD.bcast(trained(out, "serial", comm=MPI.COMM_SELF, **same)[0] if WORLD.Get_rank() == 0 else None)
    wide, wide_counters, _ = trained(out, name + "-fp32", **{**layout, "precision": "fp32"})
    assert np.all(np.abs(got - serial) <= U * serial), (got, serial)
    assert np.all(np.abs(got - wide) <= U * wide), (got, wide)
    if "cp" in layout:        # the ring ran, its messages at 2 bytes a value: half the fp32 run's bytes
        ring, wide_ring = counters["cp/send"], wide_counters["cp/send"]
        assert ring["calls"] == wide_ring["calls"] > 0 and 2 * ring["bytes"] == wide_ring["bytes"], (ring, wide_ring)
    for stats in moe:         # the experts ran: every assignment of the replica's last micro-batch counted
        tokens = BASE["batch_size"] * BASE["block_size"] * MOE["moe_top_k"]
        assert int(stats["tokens_per_expert"].sum()) + stats["dropped"] == tokens, stats
    if layout.get("ep", 1) > 1:
        assert counters["ep/all_to_allv"]["calls"] > 0, counters


# ---------------------------------------------------------------- float16 on the CuPy stand-in

@pytest.fixture
def standin(monkeypatch):
    """backend.use("cupy") gives the stand-in (MPI not CUDA-aware: staging); both sides multiply with NumPy's
    BLAS (tests/test_standin_train.py says why); NumPy again afterwards."""
    monkeypatch.setenv("MPI_TP_CUPY_STANDIN", "1")
    monkeypatch.setenv("MPI_TP_CUDA_AWARE", "0")
    monkeypatch.setenv("MPI_TP_BLAS", "numpy")
    monkeypatch.setattr(blas, "_mkl", None)
    yield
    backend.use("numpy")


@pytest.mark.mpi(min_size=1)
def test_float16_runs_on_the_standin_with_the_numpy_paths_numbers(world, standin):
    """A float16 GPT (at 1 rank with experts, gpt2 and llama; at Z ranks ring attention over cp = Z): the
    loss and every gradient on the stand-in equal NumPy's bit for bit."""
    n = world.Get_size()
    x, y = (np.random.default_rng([10, i]).integers(0, 37, (2, 8)) for i in range(2))
    for arch in ("gpt2", "llama"):
        cfg = GPTConfig(**{**TINY, "n_layer": 2, "dropout": 0.1}, **(LLAMA if arch == "llama" else {}),
                        **(MOE if n == 1 else {}))
        results = []
        for name in ("numpy", "cupy"):
            backend.use(name, world)
            topo = Topology.create(world, tp=1, cp=n)
            model = GPT(cfg, topo, dtype="float16", seed=3)
            loss = model.forward(x, y, model.new_pass(8, step=0))
            model.backward()
            results.append([loss] + [backend.asnumpy(p.grad) for p in model.parameters()])
            ok = all(p.grad.dtype == np.float16 for p in model.parameters())
            ok &= n == 1 or topo.stats.calls["cp/send"] > 0
            topo.free()
        ok &= results[0][0] == results[1][0] and all(np.array_equal(a, b) for a, b in zip(*results))
        assert all_true(ok, world), f"{arch}: float16 on the stand-in differs from NumPy's"


# ---------------------------------------------------------------- what bf16 refuses: one line each

def test_bf16_from_a_float64_checkpoint_is_one_line_saying_what_to_do(tmp_path):
    wide = dict(BASE, precision="fp32", dtype="float64", steps=1, sample_len=0)
    train(TrainConfig(**wide, out=str(tmp_path / "wide")), MPI.COMM_SELF)
    cfg = TrainConfig(**{**BASE, "init_from": str(tmp_path / "wide" / "checkpoints"), "out": str(tmp_path / "b")})
    with pytest.raises(UserError, match="holds a float64 model.*--dtype float64.*import-hf") as e:
        build(cfg, MPI.COMM_SELF)
    assert "\n" not in str(e.value)


def test_bf16_on_cupy_is_refused_in_one_line():
    with pytest.raises(UserError, match="runs on --backend numpy only: CuPy has no bfloat16 dtype .cupy/cupy#7527.*--precision fp16") as e:
        TrainConfig(**{**BASE, "backend": "cupy"}).validate(1)
    assert "\n" not in str(e.value)
