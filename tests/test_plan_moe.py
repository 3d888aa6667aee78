"""The planner's mixture of experts against independent counts: the model's parameters, the bytes each dispatcher's
counters are checked against (mpi_tp.commands.moe_common.expected_counters, on balanced routes), a capacity's
admitted share, the search choosing ep > 1 when memory forces it, and `mpi-tp plan`'s MoE options under
`mpi-tp train`'s names. (Memory per rank against a real run's arrays: tests/test_memory_moe.py, at 1-4 ranks.)

    python -m pytest -q tests/test_plan_moe.py
"""
import argparse
import dataclasses

import numpy as np
import pytest
from mpi4py import MPI
from test_memory_model import CPU

from mpi_tp.commands.moe_common import expected_counters
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.costmodel import Plan, Workload, model_flops_per_step, step_time
from mpi_tp.planning.experts import admitted_share, expert_grid_links, moe_block_bytes
from mpi_tp.planning.memory import memory_per_rank
from mpi_tp.planning.planner import plan

BYTES = dataclasses.replace(CPU, intra_alpha=0.0, inter_alpha=0.0, intra_bw=1.0, inter_bw=1.0, bytes_per_value=4)


@pytest.mark.parametrize("E, k, shared, every", [(4, 1, 0, 1), (4, 2, 1, 1), (8, 2, 2, 2), (3, 1, 0, 2), (6, 3, 1, 3)])
def test_the_workloads_parameters_are_the_models(E, k, shared, every):
    topo = Topology.create(MPI.COMM_SELF)
    cfg = GPTConfig(vocab_size=48, block_size=12, n_layer=6, n_head=4, n_embd=16, moe_experts=E, moe_top_k=k,
                    moe_shared_experts=shared, moe_every=every)
    model = GPT(cfg, topo, dtype="float32")
    w = Workload(6, 16, 4, 12, 2, 48, experts=E, top_k=k, moe_every=every, shared_experts=shared)
    assert w.params == model.num_params() and w.moe_layers == sum(b.moe for b in model.h)
    topo.free()


def balanced_routes(ep, B, S, k, E, first_only=False):
    """Every ep rank's (choice, admitted): token n's q-th choice (k n + q) mod E, each expert as often (dropless),
    or only the first choices admitted (a capacity of one half, for k = 2)."""
    n = np.arange(B * S)[:, None]
    choice = ((k * n + np.arange(k)) % E).reshape(B, S, k)
    keep = np.ones_like(choice, dtype=bool)
    if first_only:
        keep[..., 1:] = False
    return [(choice, keep)] * ep


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("ep, capacity", [(2, 0.0), (4, 0.0), (2, 0.5), (4, 0.5)])
def test_dispatch_bytes_are_the_counted_ones(dispatcher, ep, capacity):
    """On a machine of alpha 0 and 1 byte/s ep_comm is bytes on the wire: the counters' buffer bytes of a layer
    (both passes, the rows; the counts' exchange is not priced), for the all-gather's ring (ep - 1)/ep of them."""
    B, S, C, E, k = 2, 8, 16, 8, 2
    routes = balanced_routes(ep, B, S, k, E, first_only=capacity == 0.5)
    got = expected_counters(routes, E, 0, C, 4, dispatcher)["expect"]
    rows = sum(nbytes for (_, key), (_, nbytes) in got.items() if key in ("ep/all_to_allv", "ep/all_gather",
                                                                            "ep/reduce_scatter"))
    wire = rows * ((ep - 1) / ep if dispatcher == "allgather" else 1)
    w = Workload(1, C, 4, S, B * ep, 256, experts=E, top_k=k, capacity=capacity)
    lay = Plan(dp=ep, ep=ep, micro_batch=B, dispatcher=dispatcher)
    assert step_time(BYTES, w, lay)["ep_comm"] == pytest.approx(wire)


def test_a_capacity_admits_its_share_of_the_rows():
    w = Workload(2, 64, 4, 32, 8, experts=8, top_k=2)
    assert [admitted_share(dataclasses.replace(w, capacity=c)) for c in (0, 0.5, 1, 1.25)] == [1, 0.5, 1, 1]
    lay = Plan(dp=2, ep=2, micro_batch=4)
    full, half = (moe_block_bytes(CPU, dataclasses.replace(w, capacity=c), lay) for c in (0, 0.5))
    rows = 4 * 32 * 2 * 0.5                                        # the rows a capacity of 0.5 leaves out
    assert full - half == pytest.approx(rows * (64 + 3 * 256) * 4 + rows * (8 + 2 * 8))   # rows, GELU, indices
    assert step_time(CPU, dataclasses.replace(w, capacity=0.5), lay)["compute"] < step_time(CPU, w, lay)["compute"]


def test_model_flops_count_the_active_experts():
    dense = Workload(4, 64, 4, 32, 8)
    moe = dataclasses.replace(dense, experts=8, top_k=2, shared_experts=1, moe_every=2)
    assert model_flops_per_step(moe) - model_flops_per_step(dense) == 48 * 8 * 32 * 2 * 64 * 64 * 2


def test_the_expert_gradients_cross_the_edp_groups_link():
    """tp 2 x dp 4 on nodes of 4: the dense gradient's dp group crosses nodes; at ep 4, etp 2 each expert's edp
    group is one rank and nothing crosses, at ep 1, etp 1 the edp group (8 ranks) does."""
    assert expert_grid_links(Plan(tp=2, dp=4, ep=4), 4)["edp"] == "node"
    assert expert_grid_links(Plan(tp=2, dp=4, ep=1, etp=1), 4)["edp"] == "network"
    assert expert_grid_links(Plan(tp=1, dp=8, ep=2), 8)["edp"] == "node"
    from mpi_tp.planning.planner import links_text
    w, lay = Workload(2, 64, 4, 32, 8, experts=8, top_k=2), Plan(tp=2, dp=4, ep=1, etp=1)
    t = step_time(CPU, w, lay)                                     # CPU: 4 ranks a node
    assert t["links"]["edp"] == "network" and "expert gradient reductions (edp 8) cross the network" in \
        links_text(t, lay)
    one, two = (step_time(CPU, w, Plan(tp=2, dp=4, ep=e))["dp_comm"] for e in (1, 4))
    assert one > two                                               # edp 4 over the network; edp 1: no sum


def test_the_search_takes_ep_above_1_when_memory_forces_it():
    w = Workload(n_layer=2, n_embd=512, n_head=8, seq=64, global_batch=16, experts=8, top_k=2)
    m = dataclasses.replace(CPU, ranks_per_node=8, mem_bytes=1e15)
    rows = plan(m, w, 1, tp=1, pp=1)["all"]
    need = {ep: min(r["memory"]["total"] for r in rows if r["layout"].ep == ep) for ep in (1, 2, 4, 8)}
    assert need[8] < need[4] < need[2] < need[1], need          # E / ep experts a rank
    tight = dataclasses.replace(m, mem_bytes=(need[1] + need[2]) / 2)
    got = plan(tight, w, 1, tp=1, pp=1, top=1000)
    assert got["ranked"] and all(r["layout"].ep > 1 for r in got["ranked"])
    assert all(r["memory"]["total"] == memory_per_rank(tight, w, r["layout"])["total"] for r in got["ranked"][:5])


def _run(capsys, *argv):
    from mpi_tp.commands.plan import add_parser
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", "--machine", "dgx-a100", "--layers", "4", "--hidden", "512", "--heads", "8",
                          "--seq", "128", "--global-batch", "16", *argv])
    assert args.run(args, MPI.COMM_SELF) == 0
    return capsys.readouterr().out


def test_plan_takes_the_moe_options_by_trains_names(capsys):
    new = _run(capsys, "--moe-experts", "8", "--moe-top-k", "2", "--moe-shared-experts", "1", "--top", "3")
    old = _run(capsys, "--experts", "8", "--top-k", "2", "--shared-experts", "1", "--top", "3")
    assert new == old and "experts E=8 top-2 +1 shared in every block (4 of 4), dropless, alltoall" in new
    capped = _run(capsys, "--moe-experts", "8", "--moe-top-k", "2", "--moe-capacity", "0.5", "--top", "3")
    assert "capacity 0.5" in capped
    from mpi_tp.planning.machines import machine
    for d in ("alltoall", "allgather"):                           # --explain prices the dispatcher asked for
        text = _run(capsys, "--moe-experts", "8", "--moe-top-k", "2", "--moe-dispatcher", d, "--explain",
                    "tp1 pp1 dp8 ep4 b2")
        shown = float(next(x for x in text.splitlines() if x.strip().startswith("ep_comm")).split()[1])
        w = Workload(4, 512, 8, 128, 16, 51200, experts=8, top_k=2)
        want = step_time(machine("dgx-a100"), w, Plan(dp=8, ep=4, micro_batch=2, dispatcher=d))["ep_comm"]
        assert shown == pytest.approx(want, rel=1e-3), (d, shown, want)

@pytest.mark.parametrize("argv, says", [
    (["--moe-capacity", "0.5"], "--moe-capacity must be a finite number >= 0"),
    (["--moe-experts", "4", "--moe-capacity", "-1"], "--moe-capacity must be a finite number >= 0"),
    (["--moe-experts", "4", "--ep", "8"], "--ep 8 exceeds --moe-experts 4"),
    (["--moe-dispatcher", "allgather"], "--moe-dispatcher needs a mixture of experts"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 must be at most --moe-experts 4"),
])
def test_bad_moe_options_are_one_line(argv, says):
    from test_plan_inputs import MODEL, one_line_error, run_plan
    one_line_error(run_plan(*MODEL, *argv), says)
