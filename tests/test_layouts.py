"""Tensor x data parallel layouts (and, below, sequence parallelism and ZeRO-1) against the serial
model on the same global batch: same losses and weights over 10 AdamW steps (float64, < 1e-8)."""
import numpy as np
import pytest
import steps as steps_helper
from mpi4py import MPI

from mpi_tp.core.testing import all_true, assert_close, gather_full
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import train_step

pytestmark = pytest.mark.mpi(min_size=1)
# Uneven splits. Shares per rank at tp = 2 / 3 / 4 (tests/run.sh runs world sizes 1, 2, 3 and 4, each at
# every tp dividing it): heads 3+2 / 2+2+1 / 2+1+1+1; vocabulary 37 as 19+18 / 13+12+12 / 10+9+9+9;
# sequence S = 7 (sequence parallelism) as 4+3 / 3+2+2 / 2+2+2+1; MLP width 4C = 80 as 40+40 /
# 27+27+26 / 20 each (a multiple of 4: uneven at 3 ranks only).
CFG = dict(vocab_size=37, block_size=7, n_layer=2, n_head=5, n_embd=20)
B = 2                                                                     # sequences per replica


def layouts(n):
    """Every (tp, dp) with tp * dp = n."""
    return [(t, n // t) for t in range(1, n + 1) if n % t == 0]


def global_batch(step, rows):
    rng = np.random.default_rng([7, step])
    return rng.integers(0, 37, (rows, 7)), rng.integers(0, 37, (rows, 7))


def run(model, topo, rows, steps=10, overlap=True, zero=False, early=None):
    """Train on the global batch of `rows` * dp sequences, this replica taking its `rows` of them.
    Returns the losses and the optimizer. early: a list that gets, per step, how many of the gradient
    all-reduces had started before the backward pass ended (the overlap's proof)."""
    reducer = GradReducer(model, topo.dp, bucket_mb=0.001, overlap=overlap,    # tiny buckets: several per step
                          distributed=bool(zero), stage=max(int(zero), 1))
    if early is not None:
        finish, key, seen = reducer.finish, f"{topo.dp.name}/iall_reduce", [0]

        def finish_counted():
            early.append(topo.stats.started.get(key, 0) - seen[0])
            finish()
            seen[0] = topo.stats.started.get(key, 0)
        reducer.finish = finish_counted
    opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
    return steps_helper.train(model, opt, steps, rows, global_batch, reducer=reducer), opt


@pytest.fixture
def serial_reference():
    """The serial model's losses and weights on the global batch of B * dp sequences, per dp."""
    cache = {}

    def get(dp):
        if dp not in cache:
            model = GPT(GPTConfig(**CFG, dropout=0.1), Topology.serial(), dtype="float64", seed=3)
            losses, opt = run(model, model.topo, rows=B * dp)
            moments = {f"{k}/{p.name}": a.copy() for k, arrays in opt.state_tensors().items()
                       for p, a in zip(opt.params, arrays)}
            cache[dp] = losses, {p.name: p.data.copy() for p in model.parameters()}, moments
        return cache[dp]
    return get


@pytest.mark.parametrize("overlap", [True, False])
def test_tp_x_dp_equals_serial(world, serial_reference, overlap):
    for tp, dp in layouts(world.Get_size()):
        topo = Topology.create(world, tp=tp, dp=dp)
        model = GPT(GPTConfig(**CFG, dropout=0.1), topo, dtype="float64", seed=3)
        early = []
        losses, _ = run(model, topo, rows=B, overlap=overlap, early=early)
        # overlap: buckets started under the backward pass, every step; without it, none before the end
        assert all((n > 0) == (overlap and dp > 1) for n in early), (tp, dp, overlap, early)
        ref_losses, ref_weights, _ = serial_reference(dp)
        assert_close(losses, ref_losses, 1e-8, f"loss curve at tp={tp} dp={dp}")
        for p in model.parameters():
            if p.name.endswith("attn/k/bias"):
                continue        # exact gradient 0: its value is rounding noise (docs/tensor_parallelism.md)
            full = gather_full(p, topo.tp.comm)
            assert_close(full, ref_weights[p.name], 1e-8, f"{p.name} at tp={tp} dp={dp}")
        for p in model.parameters():    # every replica holds the same weights, bit for bit
            mine = p.data.copy()
            topo.dp.comm.Bcast(mine, root=0)
            assert all_true(np.array_equal(mine, p.data), world), f"{p.name} differs between replicas"


def build(topo, sp=False, dropout=0.1):
    return GPT(GPTConfig(**CFG, dropout=dropout), topo, dtype="float64", seed=3, sequence_parallel=sp)


@pytest.mark.parametrize("sp,zero", [(True, 0), (False, 1), (True, 1), (False, 2), (True, 2)],
                         ids=["sequence-parallel", "zero-1", "sequence-parallel+zero-1", "zero-2",
                              "sequence-parallel+zero-2"])
def test_sp_and_zero_equal_serial(world, serial_reference, sp, zero):
    """Sequence parallelism splits S = 7 positions over 2 (4 + 3), 3 (3 + 2 + 2) or 4 (2 + 2 + 2 + 1)
    ranks; ZeRO-1 splits every bucket's optimizer state over the replicas (unevenly too): its shares,
    gathered, are the serial run's moments, and loaded into a fresh sharded optimizer each rank takes
    back its own share."""
    for tp, dp in layouts(world.Get_size()):
        topo = Topology.create(world, tp=tp, dp=dp)
        model = build(topo, sp=sp)
        losses, opt = run(model, topo, rows=B, zero=zero)
        what = f"tp={tp} dp={dp} sp={sp} zero={zero}"
        ref_losses, ref_weights, ref_moments = serial_reference(dp)
        assert_close(losses, ref_losses, 1e-8, f"loss curve at {what}")
        for p in model.parameters():
            if not p.name.endswith("attn/k/bias"):
                assert_close(gather_full(p, topo.tp.comm), ref_weights[p.name], 1e-8, f"{p.name} at {what}")
        snap = topo.stats.snapshot()                    # ZeRO-1 ran: its reduce-scatters and all-gathers, no all-reduce
        ran = not zero or dp == 1 or (snap.get("dp/reduce_scatter", {}).get("calls", 0) > 0
                                      and snap.get("dp/all_gather", {}).get("calls", 0) > 0
                                      and "dp/iall_reduce" not in snap)
        assert all_true(ran, world), f"the distributed optimizer did not run at {what}: {sorted(snap)}"
        if zero == 2 and dp > 1:      # ZeRO-2 ran: between steps only the shares hold gradients, the buffers made anew
            held = opt.reducer.release.held_bytes() == 0 and all(p.grad.size == 0 for p in model.parameters())
            assert all_true(held, world), what
        whole = opt.state_tensors()
        for k, arrays in whole.items():
            for p, a in zip(opt.params, arrays):
                if not p.name.endswith("attn/k/bias"):
                    ref = ref_moments[f"{k}/{p.name}"][p.index()]
                    assert_close(a, ref, 1e-8, f"optimizer state {k}/{p.name} at {what}", scale=max(np.abs(ref).max(), 1e-30))
        again = AdamW(model.parameters(), lr=1e-2, reducer=opt.reducer)
        again.load_state_tensors(whole)
        same = all(np.array_equal(a, b) for k in opt.state for a, b in zip(again.state[k], opt.state[k]))
        assert all_true(same, world), f"the optimizer state does not load back share by share at {what}"


def test_sequence_parallel_moves_the_same_bytes(world):
    """TP: 4 all-reduces per block; TP+SP: 4 reduce-scatters + 4 all-gathers per block, the same wire
    bytes; plus, for the memory, the column layers' inputs gathered again in the backward pass (2 per
    block and the output layer's, half an all-reduce each), and one small all-reduce per step of the
    LayerNorm, bias and position gradients (finalize_grads)."""
    tp = world.Get_size()
    if tp == 1:
        pytest.skip("no communication at tp = 1")
    x, y = global_batch(0, B)
    snaps = []
    for sp in (False, True):
        topo = Topology.create(world)
        model = build(topo, sp=sp, dropout=0.0)
        topo.stats.reset()
        model.forward(x, y)
        model.backward()
        finalize_grads(model)
        snaps.append(topo.stats.snapshot())
    tp_only, with_sp = snaps
    L = CFG["n_layer"]
    assert with_sp["tp/reduce_scatter"]["calls"] == 4 * L + 2          # 2 per block each way; embedding; head
    assert with_sp["tp/all_gather"]["calls"] == 4 * L + 2
    assert tp_only["tp/all_reduce"]["calls"] == 4 * L + 2 + 2          # ... + the loss's two small ones
    wire = lambda snap, kinds: sum(snap[k]["wire_bytes"] for k in kinds if k in snap)
    sp_wire, tp_wire = wire(with_sp, ["tp/reduce_scatter", "tp/all_gather", "tp/all_reduce"]), \
        wire(tp_only, ["tp/all_reduce"])
    # equal up to rounding: each counter is rounded to whole bytes, and n (t-1)/t is fractional at t = 3
    assert abs(sp_wire - tp_wire) <= 2, (sp_wire, tp_wire)
    BSC = B * 7 * CFG["n_embd"] * 8
    assert with_sp["tp/regather"]["calls"] == 2 * L + 1                # q/k/v, fc, the output layer
    assert with_sp["tp/regather"]["bytes"] == (2 * L + 1) * BSC
    replicated = sum(p.grad.size for p in model.parameters() if not p.sharded)
    assert replicated == sum(p.grad.size for p in model.parameters() if p.sp_partial)
    assert with_sp["tp/sp_grad_all_reduce"]["calls"] == 1
    assert with_sp["tp/sp_grad_all_reduce"]["bytes"] == replicated * 8  # LayerNorms, biases, wpe: once each


def test_checkpoint_from_any_layout_loads_serially(world, serial_reference, tmp_path_factory):
    """Saved under tp x dp with sequence parallelism and ZeRO-1, loaded by a serial model and optimizer:
    the weights and AdamW moments are the serial run's."""
    from mpi_tp import checkpoint as ck
    for tp, dp in layouts(world.Get_size()):
        root = world.bcast(str(tmp_path_factory.mktemp(f"layout_tp{tp}_dp{dp}")) if world.Get_rank() == 0 else None)
        topo = Topology.create(world, tp=tp, dp=dp)
        model = build(topo, sp=True)
        _, trained_opt = run(model, topo, rows=B, zero=True)
        ck.save(root, 10, model, trained_opt, {"config": model.cfg.to_dict()})
        _, ref_weights, ref_moments = serial_reference(dp)
        serial = build(Topology.serial(), sp=False)
        opt = AdamW(serial.parameters())
        with ck.Checkpoint(root) as c:
            ck.load_into(c, serial, opt)
        ok = all(np.abs(p.data - ref_weights[p.name]).max() <= 1e-8 * np.abs(ref_weights[p.name]).max()
                 for p in serial.parameters() if not p.name.endswith("attn/k/bias"))
        for k, arrays in opt.state_tensors().items():
            for p, a in zip(opt.params, arrays):
                if not p.name.endswith("attn/k/bias"):
                    ref = ref_moments[f"{k}/{p.name}"]
                    ok &= np.abs(a - ref).max() <= 1e-8 * max(np.abs(ref).max(), 1e-30)
        assert all_true(ok, world), f"checkpoint saved at tp={tp} dp={dp} (sp, zero-1) differs from serial"


def test_activation_memory(world):
    """Per-block activation bytes follow docs/parallelism.md's count; with sequence parallelism at t ranks
    every term is divided by t (the column layers keep their input shard and gather it again in the
    backward pass, as Korthikanti et al. 2022 do), so 0.5x at t = 2."""
    s, b, h, a = 12, 2, 24, 12                      # S, heads and 4h divide by 1, 2, 3 and 4: equal shares
    t = world.Get_size()
    if s % t or a % t or 4 * h % t:
        pytest.skip("sequence, heads or MLP width does not divide evenly")
    cfg = GPTConfig(vocab_size=37, block_size=s, n_layer=1, n_head=a, n_embd=h)
    x = np.zeros((b, s), dtype=np.int64)
    measured = {}
    for name, topo, sp in (("serial", Topology.serial(), False), ("tp", Topology.create(world), False),
                           ("tp+sp", Topology.create(world), True)):
        model = GPT(cfg, topo, dtype="float32", sequence_parallel=sp)
        model.forward(x, x)
        measured[name] = world.allreduce(model.h[0].activation_bytes(), op=MPI.MAX)
    rstd = 2 * b * s * 4                             # the two LayerNorms' (B, S, 1) rstd
    assert measured["serial"] == 4 * (20 * s * b * h + a * s * s * b) + rstd
    # S B C (4 + 16/T) + H S^2 B / T (the variables s, b, h, a, t here), divided last so that T = 3 stays exact
    assert measured["tp"] == 4 * (s * b * h * (4 * t + 16) + a * s * s * b) / t + rstd
    assert measured["tp+sp"] * t == measured["serial"]


def test_data_parallel_moves_the_gradient_once(world):
    """The dp all-reduces of one step cover every gradient element exactly once."""
    for tp, dp in layouts(world.Get_size()):
        if dp == 1:
            continue
        topo = Topology.create(world, tp=tp, dp=dp)
        model = build(topo, dropout=0.0)
        reducer = GradReducer(model, topo.dp, bucket_mb=0.001)
        x, y = global_batch(0, B)
        topo.stats.reset()
        model.forward(x, y)
        model.backward(reducer=reducer)
        finalize_grads(model, reducer)
        snap = topo.stats.snapshot()["dp/iall_reduce"]
        grad_bytes = sum(base.nbytes for base in {id(p.base): p.base for p in model.parameters()}.values())
        assert snap["bytes"] == grad_bytes and snap["calls"] == len(reducer.buckets)
        assert abs(snap["wire_bytes"] - 2 * grad_bytes * (dp - 1) / dp) <= 1     # ring: 2n(p-1)/p
        topo.free()


def test_distributed_optimizer_moves_what_plain_dp_moves(world):
    """--zero 1 as Megatron's distributed optimizer: per step, the gradients' reduce-scatter and the
    parameters' all-gather over dp carry the wire bytes of plain data parallelism's all-reduce (one call
    of each per bucket, whatever the micro-batches), and each rank keeps 1/dp of AdamW's state."""
    for tp, dp in layouts(world.Get_size()):
        if dp == 1:
            continue
        wire, state = {}, {}
        for zero in (False, True):
            topo = Topology.create(world, tp=tp, dp=dp)
            model = build(topo, dropout=0.0, sp=tp > 1)
            reducer = GradReducer(model, topo.dp, bucket_mb=0.001, distributed=zero)
            opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
            x, y = global_batch(0, 2 * B * dp)
            topo.stats.reset()
            train_step(model, opt, x, y, topo.replica_rows(2 * B), 2, reducer=reducer)      # two micro-batches
            snap = topo.stats.snapshot()
            kinds = ("dp/reduce_scatter", "dp/all_gather") if zero else ("dp/iall_reduce",)
            assert all(snap[k]["calls"] == len(reducer.buckets) for k in kinds), (zero, snap)
            wire[zero] = sum(snap[k]["wire_bytes"] for k in kinds)
            state[zero] = world.allreduce(sum(a.nbytes for arrays in opt.state.values() for a in arrays))
            if tp > 1:                                            # sp: one sum of the replicated grads per bucket
                sums = snap["tp/sp_grad_all_reduce"]["calls"]
                assert sums == sum(b.sp.start < b.sp.stop for b in reducer.buckets), sums
            topo.free()
        assert abs(wire[True] - wire[False]) <= 2, wire            # rounding of the ring's (G-1)/G n only
        assert state[True] * dp == state[False], state


def test_sequence_parallel_overlap_changes_no_number(world):
    """The column layers' backward with the regather and dX's reduce-scatter overlapped (Megatron's order,
    MPI_TP_SP_OVERLAP=1) gives the gradients of the plain order, which test_sp_and_zero_equal_serial checks
    against the serial model."""
    x, y = global_batch(0, B)
    grads = []
    for overlap in (False, True):
        topo = Topology.create(world)
        model = build(topo, sp=True, dropout=0.1)
        model.sp_overlap = overlap                       # its passes' SequenceSplit.overlap
        model.forward(x, y)
        model.backward()
        finalize_grads(model)
        grads.append({p.name: p.grad.copy() for p in model.parameters()})
        calls = topo.stats.calls.get("tp/regather", 0)
        assert calls == (2 * CFG["n_layer"] + 1 if world.Get_size() > 1 else 0), calls
        # the proof that Megatron's order ran: only it starts dX's reduce-scatter without waiting (the
        # plain order's is blocking), once per column layer
        started = topo.stats.started.get("tp/reduce_scatter", 0)
        assert started == (calls if overlap else 0), (overlap, started, calls)
        topo.free()
    scale = max(float(np.abs(g).max()) for g in grads[0].values())
    worst = max(float(np.abs(grads[0][k] - grads[1][k]).max()) for k in grads[0]) / scale
    assert all_true(worst <= 1e-13, world), worst


def test_buckets_are_cut_alike_on_every_tp_rank(world):
    """Uneven head shares (5 heads) give the tensor-parallel ranks blocks of different sizes. With a bucket
    size between them, each rank cut its buckets at other blocks, so the all-reduces over tp that start a
    bucket (sequence parallelism's) did not pair up: a hang. Buckets are cut on the largest block sizes."""
    from mpi_tp.parallel.data_parallel import GradReducer
    topo = Topology.create(world)
    model = build(topo, sp=True, dropout=0.0)
    sizes = world.allgather(sum(p.grad.nbytes for p in model.h[0].parameters()))
    if min(sizes) == max(sizes):
        pytest.skip("the ranks' blocks are the same size: no bucket size lies between them")
    reducer = GradReducer(model, topo.dp, bucket_mb=(min(sizes) + max(sizes)) / 2 / 2**20)
    cuts = world.allgather([sorted(b.blocks) for b in reducer.buckets])
    assert all(c == cuts[0] for c in cuts), cuts
    serial = build(Topology.serial(), dropout=0.0)
    x, y = global_batch(0, B)
    for m in (model, serial):
        m.forward(x, y)
    model.backward(reducer=reducer)
    finalize_grads(model, reducer)
    serial.backward()
    ref = {p.name: p.grad for p in serial.parameters()}
    scale = max(float(np.abs(g).max()) for g in ref.values())
    for p in model.parameters():
        assert_close(p.grad, ref[p.name][p.index()], 1e-10, p.name, scale)
