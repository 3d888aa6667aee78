"""The planner: search every layout the engine trains with the cost model and explain the winner.

Every layout with tp x cp x pp x dp = the machine's ranks is tried (`candidates`: uneven heads
and stages, interleaving and the zero-bubble schedules, cp for long sequences, ep for a mixture of
experts), with micro-batch sizes, sequence parallelism, ZeRO 1-3 and recomputation; those whose memory per rank exceeds the
machine's are dropped; the rest are ranked by predicted step time (`plan`), and the winner is
explained against the best layout with another tensor-parallel size, with the links its groups
cross (`explain`). The command line is mpi_tp.commands.plan (`mpi-tp plan`, with pins and
--explain LAYOUT; --emit-config writes the winner as a config `mpi-tp train --config` runs).

The cost model prices what the engine does: the interleaved and zero-bubble bubbles, the largest of uneven
stages, the rank with the most heads, the GEMM rate of each micro-batch size (a calibrated
machine's curve), each group on the links its members cross, and the data-parallel all-reduce
hidden behind the last backward pass. experiments/planner/published_layouts.py checks it against
Narayanan et al. 2021's Table 1 and other published runs (tests/test_costmodel.py).
"""
from __future__ import annotations

from dataclasses import replace

from mpi_tp.planning.bubble import ZERO_BUBBLE
from mpi_tp.planning.costmodel import Plan, Workload, achieved, step_time
from mpi_tp.planning.memory import memory_per_rank
from mpi_tp.planning.plan_table import size_text

CP_POSITIONS = 1024   # context parallelism is considered where each rank keeps at least this many positions of a
#                       sequence (or asked for: --cp); fewer, and a ring step's block is too small to hide its K/V
SCHEDULES = ("1f1b", "interleaved", *ZERO_BUBBLE)      # the pipeline schedules priced (ties: the first wins)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) (a global batch of 4e8 sequences included)."""
    small = [k for k in range(1, int(n ** 0.5) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def candidates(w: Workload, ranks: int, per_node: int, max_tp: int | None = None, tp_only: int | None = None,
               pp_only: int | None = None, micro_only: int | None = None, sp=(False, True), zeros=(0, 1, 2, 3),
               recomputes=(False, True), cp_only: int | None = None, schedules=SCHEDULES,
               virtual: int | None = None, even_stages: bool = False, ep_only: int | None = None,
               etp_only: int | None = None, dispatcher: str = "alltoall", overlap_tp: bool = False):
    """Layouts to price, every one the engine trains: tp up to the heads (and max_tp; heads need not divide:
    uneven), cp > 1 where each rank keeps CP_POSITIONS positions or more, pp up to the
    layers (stages need not divide them: the largest sets the pace), interleaving (v chunks a stage, 2 up to
    its layers, or `virtual`) where the micro-batches are a multiple of the stages and every chunk has a block, the
    zero-bubble schedules where there are at least as many micro-batches as stages (zb-v: and every chunk
    of its V has a block), dp the rest; micro-batches up to 16 sequences; ZeRO stages 1-3 where dp x cp > 1.
    The end stages a block lighter where that costs no time (_ends). Pins: tp_only, cp_only, pp_only, micro_only,
    virtual, ep_only, etp_only (a mixture of experts: etp tp or a divisor of it, ep x etp dividing tp x cp x dp, ep
    at most the experts; dispatcher: theirs); schedules (of SCHEDULES), sp, zeros, recomputes: the settings
    allowed; even_stages: only stage counts that divide the layers (the search space of papers that had only
    those); overlap_tp: price the tensor-parallel collectives as Transformer Engine overlaps them
    (Plan.overlap_tp)."""
    for tp in divisors(ranks):
        if tp > w.n_head or (max_tp and tp > max_tp) or (tp_only and tp != tp_only):
            continue
        for cp, pp in ((c, p) for c in divisors(ranks // tp) for p in divisors(ranks // (tp * c))):
            if (cp_only and cp != cp_only) or (not cp_only and cp > 1 and w.seq < CP_POSITIONS * cp):
                continue
            if pp > w.n_layer or (pp_only and pp != pp_only) or cp > w.seq // 2 or (even_stages and w.n_layer % pp):
                continue
            dp = ranks // (tp * cp * pp)
            if w.global_batch % dp:
                continue
            for b in divisors(w.global_batch // dp):
                if b > 16:
                    break
                if micro_only and b != micro_only:
                    continue
                micro = w.global_batch // (dp * b)
                for (v, zb), (ep, etp) in ((x, e) for x in _schedules(w, pp, micro, schedules, virtual)
                                           for e in _experts(w, tp, cp, dp, ep_only, etp_only)):
                    for seq, ends in ((q, e) for q in (sp if tp > 1 else (False,)) for e in _ends(w, pp, v)):
                        for zero in (zeros if dp * cp > 1 else (0,)):
                            for recompute in recomputes:
                                yield Plan(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, etp=etp, virtual=v, sp=seq,
                                           zero=zero, micro_batch=b, recompute=recompute, schedule=zb,
                                           dispatcher=dispatcher, first_stage_layers=ends,
                                           last_stage_layers=ends, overlap_tp=overlap_tp and tp > 1)


def _ends(w: Workload, pp: int, v: int) -> tuple:
    """The end stages' blocks to try: the engine's split (0), and, where at least two stages come a block short
    anyway (n P - L >= 2, n = ceil(L / P)) and a stage lies between, those short stages at the ends (n - 1
    blocks each: Llama 3's placement, the first stage's activations and the last's logits on the lighter
    ones) at the same pace."""
    n = -(-w.n_layer // pp)
    return (0, n - 1) if pp >= 3 and n * pp - w.n_layer >= 2 and n - 1 >= v else (0,)


def _experts(w: Workload, tp: int, cp: int, dp: int, ep_only: int | None, etp_only: int | None) -> list[tuple]:
    """(ep, etp) to try (etp 0: tp's): etp tp or a divisor of it (or the pin), ep up to the experts with ep x etp
    dividing the stage's tp x cp x dp ranks (mpi_tp.parallel.expert_grid); (1, 0) for a dense model."""
    if not w.experts:
        return [(1, 0)]
    stage = tp * cp * dp
    out = []
    for etp in ([etp_only] if etp_only else divisors(tp)):
        if stage % etp or etp > w.ffn:
            continue
        out += [(e, 0 if etp == tp else etp) for e in divisors(stage // etp)
                if e <= w.experts and (not ep_only or e == ep_only)]
    return out


def _schedules(w: Workload, pp: int, micro: int, schedules, virtual: int | None) -> list[tuple]:
    """(chunks per stage, zero-bubble schedule or None) pairs to try, of those `schedules` allows: (1, None)
    1F1B; (v, None) interleaved, v from 2 to a stage's layers (chunk_counts; or `virtual`: then nothing else)
    where it runs; (1, "zb-h1") and
    (2, "zb-v") where M >= P, their formulas' steady state (mpi_tp.planning.bubble), zb-v where each of
    the 2 P chunks has a block. One stage: (1, None), unless only pipelined schedules are allowed."""
    if pp == 1:
        return [(1, None)] if "1f1b" in schedules and not virtual else []
    found = {"1f1b": (1, None)}
    if micro % pp == 0:          # v from 2 up to a stage's layers (each chunk has a block), or the pin
        found["interleaved"] = [(v, None) for v in ([virtual] if virtual else chunk_counts(w.n_layer, pp))
                                if w.n_layer >= v * pp]
    if micro >= pp:
        found["zb-h1"] = (1, "zb-h1")
        if w.n_layer >= 2 * pp:
            found["zb-v"] = (2, "zb-v")
    if virtual:
        schedules = [x for x in schedules if x == "interleaved"]
    out = []
    for x in (x for x in schedules if x in found):
        out += found[x] if isinstance(found[x], list) else [found[x]]
    return out


def chunk_counts(L: int, P: int) -> list[int]:
    """The v >= 2 worth pricing for L blocks on P stages: the fewest chunks for each chunk size c (v = ceil(L /
    (P c))): a larger v with chunks as large idles as long (the largest chunk sets the pace) for more messages."""
    return sorted({-(-L // (P * c)) for c in range(1, -(-L // P) + 1)} - {1})


def plan(m, w: Workload, nodes: int, top: int = 10, max_tp: int | None = None, tp: int | None = None,
         pp: int | None = None, **allowed) -> dict:
    """allowed: candidates()'s micro_only, sp, zeros, recomputes, cp_only, schedules, virtual, even_stages, ep_only,
    overlap_tp."""
    ranks = nodes * m.ranks_per_node
    rows = [price(m, w, lay) for lay in candidates(w, ranks, m.ranks_per_node, max_tp, tp, pp, **allowed)]
    fitting, seen = [], set()
    for r in sorted((r for r in rows if r["fits"]), key=lambda r: (r["time"]["total"], r["memory"]["total"])):
        lay = r["layout"]            # the interleaved schedule at its best v, the ends at their best (the lighter
        key = replace(lay, first_stage_layers=0, last_stage_layers=0)  # at a tie): searched, not new layouts
        key = replace(key, virtual=0) if lay.schedule is None and lay.virtual > 1 else key
        if key not in seen:
            seen.add(key)
            fitting.append(r)
    return {"machine": m.name, "ranks": ranks, "workload": w, "ranked": fitting[:top], "all": rows,
            "why": explain(fitting, rows, m)}


def price(m, w: Workload, lay: Plan) -> dict:
    """One layout's row: its step time and parts, memory per rank, whether it fits, the FLOP/s it achieves."""
    mem = memory_per_rank(m, w, lay)
    t = step_time(m, w, lay)
    return {"layout": lay, "time": t, "memory": mem, "fits": mem["total"] <= m.mem_bytes,
            "achieved": achieved(m, w, lay, t["total"])}


def _ranks(n: int) -> str:
    return f"{n} rank{'s' * (n != 1)}"


def links_text(t: dict, lay: Plan) -> str:
    """Which links the layout's groups cross, in words."""
    links = t["links"]
    sizes = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp * lay.cp}
    names = {"tp": "tensor-parallel groups", "cp": "context-parallel rings", "pp": "pipeline hops",
             "dp": "gradient reductions", "ep": f"expert dispatches (ep {lay.ep})",
             "etp": f"expert tensor-parallel groups (etp {lay.expert_tp})",
             "edp": f"expert gradient reductions (edp {lay.edp})"}
    if "edp" in links:               # a mixture of experts (etp shown when it is not tp's group)
        sizes.update(ep=lay.ep, etp=lay.expert_tp if lay.expert_tp != lay.tp else 1, edp=lay.edp)
    used = [k for k in ("tp", "cp", "pp", "dp", "ep", "etp", "edp") if sizes.get(k, 1) > 1]
    inside = [names[k] for k in used if links[k] == "node"]
    across = [names[k] for k in used if links[k] == "network"]
    parts = []
    if "tp" in used or lay.tp == 1:
        parts.append(f"its tensor-parallel groups ({_ranks(lay.tp)}) " + (
            "stay inside a node" if links["tp"] == "node" else "straddle nodes: their all-reduces cross the network"))
    rest = [x for x in inside if x != names["tp"]]
    if rest:
        parts.append(f"{', '.join(rest)} stay inside a node")
    rest = [x for x in across if x != names["tp"]]
    if rest:
        parts.append(f"{', '.join(rest)} cross the network")
    return "; ".join(parts) + "."


def explain(fitting, rows, m) -> str:
    if not fitting:
        smallest = min(rows, key=lambda r: r["memory"]["total"]) if rows else None
        need = size_text(smallest['memory']['total']) if smallest else "?"
        return (f"no layout fits in {m.mem_bytes / 1e9:.0f} GB per rank (the smallest needs {need}): "
                "use more nodes, or a machine with more memory")
    best = fitting[0]
    lay, t = best["layout"], best["time"]
    parts = sorted(((k, v) for k, v in t.items() if isinstance(v, float | int) and k not in
                    ("total", "micro_batches", "dp_hidden", "w_share")), key=lambda kv: -kv[1])

    def sec(x: float) -> str:       # seconds, or ms for a laptop-sized step, as the table's time columns
        return f"{x:.3f} s" if t["total"] >= 0.1 else f"{1e3 * x:.3f} ms"

    lines = [f"best: {lay.describe()}, {sec(t['total'])} per step, {size_text(best['memory']['total'])} per rank; "
             "time goes to " + ", ".join(f"{k} {sec(v)}" for k, v in parts if v > 0)]
    lines.append(links_text(t, lay))
    others = [r for r in fitting if r["layout"].tp != lay.tp]
    if others:
        o = others[0]
        ol, ot = o["layout"], o["time"]
        diff = ot["total"] - t["total"]
        reason = []
        if ot["tp_comm"] > t["tp_comm"]:
            crossing = " (its groups cross the network)" if ot["links"]["tp"] == "network" else ""
            reason.append(f"tensor-parallel all-reduces take {sec(ot['tp_comm'])} instead of {sec(t['tp_comm'])}"
                          + crossing)
        if ot["bubble"] > t["bubble"]:
            reason.append(f"the pipeline bubble costs {sec(ot['bubble'])}")
        if ot["dp_comm"] > t["dp_comm"]:
            reason.append(f"the gradient all-reduce takes {sec(ot['dp_comm'])}")
        if ot["compute"] > t["compute"]:
            reason.append(f"compute is {sec(ot['compute'])} (less work split per rank)")
        lines.append(f"the best with tp={ol.tp} ({ol.describe()}) is {sec(diff)} slower: " +
                     ("; ".join(reason) or "a mix of smaller differences"))
    unfit = sum(1 for r in rows if not r["fits"])
    if unfit:
        lines.append(f"{unfit} of {len(rows)} layouts do not fit in {m.mem_bytes / 1e9:.0f} GB per rank.")
    return "\n".join(lines)
