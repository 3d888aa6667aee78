"""Mixture-of-experts GPT at every layout (tp x dp, experts over ep dividing dp) against the serial MoE
model on the same global batch: losses, gradient norms and weights over 5 AdamW steps (float64,
1e-8; first loss 1e-10), the same dropped assignments, and the all-to-all's counted calls and bytes.

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_moe.py     (N = 1 .. 4)
"""
import numpy as np
import pytest
from steps import node_by_node_calls

from mpi_tp.core.testing import all_true, assert_close, gather_full, max_rel_diff
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.expert_balance import balance_experts
from mpi_tp.parallel.expert_parallel import (
    ExpertDispatcher,
    GatherDispatcher,
    expert_of,
)
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.topology import Topology, offsets, split_sizes
from mpi_tp.training.optim import AdamW, clip_coefficient, grad_norm

pytestmark = pytest.mark.mpi(min_size=1)
CFG = dict(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1,
           moe_aux_weight=0.05, moe_z_weight=0.01)
MOE = {   # E = 3 splits unevenly over ep = 2 (2 + 1); E = 4 over ep = 3 (2 + 1 + 1)
    "E4-top2": dict(moe_experts=4, moe_top_k=2),
    "E3-top1-capacity-every2": dict(moe_experts=3, moe_top_k=1, moe_capacity=1.0, moe_every=2),
    "E3-top2-capacity": dict(moe_experts=3, moe_top_k=2, moe_capacity=1.0),
    "E4-top1-capacity": dict(moe_experts=4, moe_top_k=1, moe_capacity=1.25),
    # the routers of DeepSeek-V3 (sigmoid, scaled gates, a shared expert) and Mixtral, dropping by probability
    "E4-top2-sigmoid-shared": dict(moe_experts=4, moe_top_k=2, moe_router="sigmoid", moe_gate_scale=2.5,
                                   moe_shared_experts=1),
    "E3-top2-topk-softmax-probs": dict(moe_experts=3, moe_top_k=2, moe_router="topk-softmax", moe_capacity=1.0,
                                       moe_drop_policy="probs"),
    # the aux-loss-free balance: the bias moved by the global batch's loads after each step
    "E4-top2-sigmoid-bias": dict(moe_experts=4, moe_top_k=2, moe_router="sigmoid", moe_bias_rate=0.05),
    # the all-gather dispatcher (the others: all-to-all)
    "E3-top2-capacity-allgather": dict(moe_experts=3, moe_top_k=2, moe_capacity=1.0, moe_dispatcher="allgather"),
}
B, T, STEPS = 2, 8, 5                               # sequences per replica, positions, AdamW steps


def layouts(n):
    """Every (tp, dp, ep): tp in {1, 2}, tp dp = n, ep dividing dp (ep = 3 at dp = 3: uneven experts)."""
    return [(tp, n // tp, ep) for tp in (1, 2) if n % tp == 0 for ep in (1, 2, 3, 4) if (n // tp) % ep == 0]


def global_batch(step, rows):
    rng = np.random.default_rng([5, step])
    return rng.integers(0, 37, (rows, T)), rng.integers(0, 37, (rows, T))


def run(model, topo, rows):
    """5 AdamW steps on the global batch (rows per replica): losses, norms, routing per step and layer."""
    params = model.parameters()
    reducer = GradReducer(model, topo.dpcp, bucket_mb=0.001)        # tiny buckets: several per step
    opt = AdamW(params, lr=1e-2)
    losses, norms, routing = [], [], []
    for step in range(STEPS):
        x, y = global_batch(step, rows * topo.dp.size)
        mine = topo.replica_rows(rows)
        model.zero_grad()
        ps = model.new_pass(x.shape[1], row0=mine.start, step=step)      # this replica's rows of step's batch
        loss = np.array([model.forward(x[mine], y[mine], ps)])          # the whole sequences' loss (cp too)
        topo.dp.all_reduce(loss)
        losses.append(loss[0] / topo.dp.size)
        routing.append([(c.copy(), a.copy()) for c, a in (m.routing for m in model.moe_layers())])
        model.backward(reducer=reducer)
        finalize_grads(model, reducer)
        norms.append(grad_norm(params, topo.tp))
        opt.step(grad_scale=clip_coefficient(norms[-1], 1.0))
        balance_experts(model)
    return np.array(losses), np.array(norms), routing


_serial = {}
SERIAL = Topology.serial()          # one for every reference model: a Topology holds several communicators


def serial_reference(name, dp):
    if (name, dp) not in _serial:
        model = GPT(GPTConfig(**CFG, **MOE[name]), SERIAL, dtype="float64", seed=3)
        losses, norms, routing = run(model, model.topo, rows=B * dp)
        _serial[name, dp] = losses, norms, routing, {p.name: p.data.copy() for p in model.parameters() + model.buffers()}
    return _serial[name, dp]


@pytest.mark.parametrize("name", list(MOE))
def test_moe_layouts_equal_serial(world, name):
    for tp, dp, ep in layouts(world.Get_size()):
        cfg = GPTConfig(**CFG, **MOE[name])
        topo = Topology.create(world, tp=tp, dp=dp, ep=ep)
        what = f"{name} at tp={tp} dp={dp} ep={ep}"
        if ep > cfg.moe_experts:
            with pytest.raises(ConfigError, match=f"ep={ep}"):
                GPT(cfg, topo, dtype="float64", seed=3)
            topo.free()
            continue
        model = GPT(cfg, topo, dtype="float64", seed=3)
        losses, norms, routing = run(model, topo, rows=B)
        ref_losses, ref_norms, ref_routing, ref_weights = serial_reference(name, dp)
        assert_close(losses[:1], ref_losses[:1], 1e-10, f"first loss, {what}")
        assert_close(losses, ref_losses, 1e-8, f"loss curve, {what}")
        assert_close(norms[:1], ref_norms[:1], 1e-10, f"first gradient norm, {what}")
        assert_close(norms, ref_norms, 1e-8, f"gradient norms, {what}")
        mine = topo.replica_rows(B)
        same = all(np.array_equal(c, rc[mine]) and np.array_equal(a, ra[mine])
                   for step, ref_step in zip(routing, ref_routing) for (c, a), (rc, ra) in zip(step, ref_step))
        assert all_true(same, world), f"routing or dropped assignments differ from serial, {what}"
        if cfg.moe_capacity:
            dropped = sum(int((~a).sum()) for step in routing for _, a in step)
            assert world.allreduce(dropped) > 0, f"no assignment was dropped, {what}: the test proves nothing"
        # Ranks hold different numbers of experts: compare locally, agree once.
        bad = [f"{p.name}: {max_rel_diff(gather_full(p, topo.tp.comm), ref_weights[p.name]):.2e}"
               for p in model.parameters() if not p.name.endswith("attn/k/bias")    # exact gradient 0
               and max_rel_diff(gather_full(p, topo.tp.comm), ref_weights[p.name]) > 1e-8]
        assert all_true(not bad, world), f"weights after {STEPS} steps differ from serial, {what}: {bad}"
        biases = [b for b in model.buffers() if not np.array_equal(b.data, ref_weights[b.name])]
        assert all_true(not biases, world), f"expert biases differ from serial, {what}: {[b.name for b in biases]}"
        if cfg.moe_bias_rate:
            assert all(np.abs(b.data).max() > 0 for b in model.buffers()), f"no bias moved, {what}"
        held = {p.name for p in model.parameters() + model.buffers()}
        everywhere = set().union(*topo.ep.comm.allgather(held))
        assert all_true(everywhere == set(ref_weights), world), f"some parameter is nowhere, {what}"
        same = True                                     # replicas hold the same numbers, bit for bit
        for expert in (False, True):                    # dense ones over dp, each expert's over edp
            for p in model.parameters():
                if (expert_of(p) is not None) == expert:
                    group = topo.edp.comm if expert else topo.dp.comm
                    same &= np.array_equal(group.bcast(p.data, root=0), p.data)
        assert all_true(same, world), f"replicas differ, {what}"
        topo.free()


def moved_rows(model, topo):
    """(rows this rank sends to other ep ranks, rows it receives from them) per MoE layer, from the
    routing of every ep rank at the positions it owns (not from the dispatcher)."""
    out = []
    for m in model.moe_layers():
        choice, keep = (a[:, m._owners.positions] for a in m.routing)
        starts = offsets(split_sizes(m.E, topo.ep.size))
        owner = np.searchsorted(starts, choice[keep], side="right") - 1
        every = topo.ep.comm.allgather(np.bincount(owner, minlength=topo.ep.size))   # [source][destination]
        me = topo.ep.rank
        out.append((sum(every[me]) - every[me][me], sum(e[me] for e in every) - every[me][me]))
    return out


def test_all_to_all_calls_and_bytes(world):
    """Per MoE layer: one Alltoall of counts, 4 Alltoallv of rows (2 forward, 2 backward), bytes = rows
    leaving the rank x C x 8, both ways; the expert gradients reduced over edp, the rest over dp."""
    for tp, dp, ep in layouts(world.Get_size()):
        cfg = GPTConfig(**{**CFG, "dropout": 0.0}, **MOE["E4-top2"])
        if ep > cfg.moe_experts:
            continue
        topo = Topology.create(world, tp=tp, dp=dp, ep=ep)
        model = GPT(cfg, topo, dtype="float64", seed=3)
        reducer = GradReducer(model, topo.dp, bucket_mb=0.001)
        x, y = global_batch(0, B * dp)
        mine = topo.replica_rows(B)
        topo.stats.reset()
        model.forward(x[mine], y[mine])
        model.backward(reducer=reducer)
        finalize_grads(model, reducer)
        snap = topo.stats.snapshot()
        L, C = len(model.moe_layers()), cfg.n_embd
        what = f"tp={tp} dp={dp} ep={ep}"
        if ep == 1:
            ok = not any(k.startswith("ep/") for k in snap)
        else:
            rows = sum(sent + got for sent, got in moved_rows(model, topo))
            counts = snap["ep/all_to_all"]
            v = snap["ep/all_to_allv"]
            ok = (counts["calls"] == L and counts["bytes"] == L * (ep - 1) * max(split_sizes(4, ep)) * 8
                  and v["calls"] == 4 * L and v["bytes"] == 2 * rows * C * 8 and v["wire_bytes"] == v["bytes"])
        nbytes = {False: {}, True: {}}                  # gradient bytes, dense and experts, each storage once
        for p in model.parameters():
            nbytes[expert_of(p) is not None][id(p.base)] = p.base.nbytes
        dense, experts = sum(nbytes[False].values()), sum(nbytes[True].values())
        if dp > 1:    # ep = 1: edp is dp itself; ep = dp: one replica per expert, nothing to sum
            ok &= snap["dp/iall_reduce"]["bytes"] == dense + (experts if ep == 1 else 0)
            ok &= snap.get("edp/iall_reduce", {"bytes": 0})["bytes"] == (experts if 1 < ep < dp else 0)
        assert all_true(ok, world), f"all-to-all or reduction counters at {what}: {snap}"
        topo.free()


@pytest.mark.parametrize("dispatcher", [ExpertDispatcher, GatherDispatcher])
def test_dispatch_and_combine_closed_form(world, dispatcher):
    """Rank s sends (s + e) % 3 rows to expert e, each row filled with 100 s + e; expert j's rows must
    arrive source by source; combine brings 2 x those rows back in the sender's order. Both dispatchers."""
    n = world.Get_size()
    topo = Topology.create(world, tp=1, dp=n, ep=n)
    E = n + 1 if n > 1 else 3                               # uneven: one rank holds two experts
    d = dispatcher(E, topo.ep)
    s = topo.ep.rank
    per_expert = np.array([(s + e) % 3 for e in range(E)])
    x = np.concatenate([np.full((per_expert[e], 4), 100.0 * s + e) for e in range(E)])
    plan = d.plan(per_expert)
    got = d.dispatch(x, plan)
    want = np.concatenate([np.full(((r + e) % 3, 4), 100.0 * r + e) for e in d.local for r in range(n)])
    assert all_true(np.array_equal(got, want), world), "dispatch: rows in the wrong place"
    assert all_true(plan.expert_rows == [sum((r + e) % 3 for r in range(n)) for e in d.local], world)
    back = d.combine(2 * got, plan)
    assert all_true(np.array_equal(back, 2 * x), world), "combine is not dispatch's inverse"
    topo.free()


def test_both_dispatchers_give_the_same_numbers(world):
    """At ep = every rank (and tp 2 x ep 2 at 4 ranks): the all-gather dispatcher's loss and every gradient
    equal the all-to-all's bit for bit. Its collectives, per MoE layer: one all-gather of the E row counts of
    every rank, two all-gathers of the ep group's rows (dispatch, and combine's gradient) and two
    reduce-scatters (combine, and dispatch's gradient), each of (rows of the ep group) x C x 8 bytes; no
    all-to-all."""
    n = world.Get_size()
    tp, ep = (2, 2) if n == 4 else (1, n)
    x, y = global_batch(0, B * n // tp)
    grads, snaps = {}, {}
    for kind in ("alltoall", "allgather"):
        cfg = GPTConfig(**{**CFG, "dropout": 0.0}, **MOE["E3-top2-capacity"], moe_dispatcher=kind)
        topo = Topology.create(world, tp=tp, dp=n // tp, ep=ep)
        model = GPT(cfg, topo, dtype="float64", seed=3)
        mine = topo.replica_rows(B)
        topo.stats.reset()
        loss = model.forward(x[mine], y[mine])
        model.backward()
        snaps[kind] = topo.stats.snapshot()
        grads[kind] = [loss] + [p.grad.copy() for p in model.parameters()]
        rows = sum(topo.ep.comm.allreduce(int(m.routing[1][:, m._owners.positions].sum())) for m in model.moe_layers())
        L, C = len(model.moe_layers()), cfg.n_embd
        topo.free()
    same = all(np.array_equal(a, b) for a, b in zip(grads["alltoall"], grads["allgather"]))
    assert all_true(same, world), "the dispatchers' losses or gradients differ"
    g = snaps["allgather"]
    if ep == 1:
        ok = not any(k.startswith("ep/") for k in g)
    else:
        ok = (not any("all_to_all" in k for k in g) and g["ep/all_gather_counts"]["calls"] == L
              and g["ep/all_gather_counts"]["bytes"] == L * ep * 3 * 8
              and g["ep/all_gather"]["calls"] == 2 * L and g["ep/all_gather"]["bytes"] == 2 * rows * C * 8
              and g["ep/reduce_scatter"]["calls"] == 2 * L and g["ep/reduce_scatter"]["bytes"] == 2 * rows * C * 8)
    assert all_true(ok, world), f"all-gather dispatcher's counters at tp={tp} ep={ep}: {g}"


def test_recompute_full_gives_the_same_gradients(world):
    n = world.Get_size()
    cfg = GPTConfig(**{**CFG, "dropout": 0.1}, **MOE["E3-top2-capacity"])
    x, y = global_batch(0, B)
    grads, kept = [], []
    for recompute in ("none", "full"):
        topo = Topology.create(world, tp=1, dp=n, ep=n if n < 4 else 2)
        model = GPT(cfg, topo, dtype="float64", seed=3, recompute=recompute)
        model.forward(x, y)
        kept.append([b.activation_bytes() for b in model.h if b.moe])    # what each MoE block keeps
        model.backward()
        grads.append([p.grad.copy() for p in model.parameters()])
        topo.free()
    # the proof that the MoE blocks recomputed: under "full" each keeps its input only, B S_i C values
    assert kept[0] and all(full == x.shape[0] * x.shape[1] * CFG["n_embd"] * 8 < none
                           for none, full in zip(*kept)), kept
    assert all_true(all(np.array_equal(a, b) for a, b in zip(*grads)), world)


def test_hierarchical_reduction_matches_flat(world):
    """GradReducer(hierarchical=True) reduces the expert buckets over edp node by node too."""
    for tp, dp, ep in layouts(world.Get_size()):
        if dp == 1 or ep > 3:
            continue
        topo = Topology.create(world, tp=tp, dp=dp, ep=ep)
        cfg = GPTConfig(**{**CFG, "dropout": 0.0}, **MOE["E3-top2-capacity"])
        x, y = global_batch(0, B * dp)
        mine = topo.replica_rows(B)
        grads = []
        for hierarchical in (False, True):
            model = GPT(cfg, topo, dtype="float64", seed=3)
            model.forward(x[mine], y[mine])
            reducer = GradReducer(model, topo.dp, bucket_mb=0.001, hierarchical=hierarchical)
            topo.stats.reset()
            model.backward(reducer=reducer)
            finalize_grads(model, reducer)
            grads.append([p.grad.copy() for p in model.parameters()])
            went = node_by_node_calls(topo.stats) > 0          # the hierarchical reducer went node by node
            assert all_true(went == hierarchical, world), f"tp={tp} dp={dp} ep={ep} hierarchical={hierarchical}"
        scale = max(np.abs(g).max() for g in grads[0])
        worst = max(np.abs(a - b).max() for a, b in zip(*grads)) / scale
        assert all_true(worst < 1e-13, world), f"hierarchical differs at tp={tp} dp={dp} ep={ep}: {worst:.1e}"
        topo.free()
