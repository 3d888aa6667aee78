"""`mpi-tp plan`: search tensor x pipeline x data layouts with the cost model and explain the winner.

    mpi-tp plan --machine dgx-a100 --nodes 4 --layers 48 --hidden 6144 --heads 48 --seq 2048 \\
                --global-batch 512 --vocab 51200

Every layout with tp x pp x dp = nodes x ranks per node is tried, with
micro-batch sizes, sequence parallelism, ZeRO-1 and recomputation; those whose
memory per rank exceeds the machine's are dropped; the rest are ranked by
predicted step time. The winner is explained against the best layout with
another tensor-parallel size.

mpi_tp runs every dimension priced here (`mpi-tp train --tp --pp --dp
--micro-batches --schedule --virtual-stages --sequence-parallel --zero 1
--recompute`), and `--emit-config FILE` writes the winner as a config that
`mpi-tp train --config FILE` runs. The cost model prices what the engine does:
the interleaved bubble, the largest of uneven stages, the rank with the most
heads, the GEMM rate of each micro-batch size (a calibrated machine's curve),
and the data-parallel all-reduce hidden behind the last backward pass.
experiments/published_layouts.py checks it against Narayanan et al. 2021's
Table 1 (tests/test_costmodel.py).
"""
from __future__ import annotations

import json
import os
import re
import sys

from mpi_tp.core.errors import UserError, refuse_to_replace
from mpi_tp.planning.costmodel import Layout, Workload, achieved, step_time
from mpi_tp.planning.machines import PRESETS, machine
from mpi_tp.planning.memory import memory_per_rank
from mpi_tp.planning.plan_table import legend, size_text, table

MODEL_FLAGS = ("--layers", "--hidden", "--heads", "--seq", "--global-batch")     # the model: required


LONG = 8192        # context parallelism is considered from this sequence length on (or asked for: --cp)


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) (a global batch of 4e8 sequences included)."""
    small = [k for k in range(1, int(n ** 0.5) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def candidates(w: Workload, ranks: int, per_node: int, max_tp: int | None = None, tp_only: int | None = None,
               pp_only: int | None = None, micro_only: int | None = None, sp=(False, True), zeros=(0, 1),
               recomputes=(False, True), cp_only: int | None = None, schedule: str | None = None,
               virtual: int | None = None, even_stages: bool = False, ep_only: int | None = None):
    """Layouts to price, every one the engine trains: tp up to the heads (and max_tp; heads need not divide:
    uneven), cp > 1 for sequences of LONG positions or more (at least 4 positions per rank), pp up to the
    layers (stages need not divide them: the largest sets the pace), interleaving (2 chunks a stage, or
    `virtual`) where the micro-batches are a multiple of the stages and every chunk has a block, dp the
    rest; micro-batches up to 16 sequences. Pins: tp_only, cp_only, pp_only, micro_only, schedule
    ("1f1b" or "interleaved"), virtual, ep_only (a mixture of experts: ep divides dp, at most the experts);
    sp, zeros, recomputes: the settings allowed; even_stages: only stage
    counts that divide the layers (the search space of papers that had only those)."""
    for tp in divisors(ranks):
        if tp > w.n_head or (max_tp and tp > max_tp) or (tp_only and tp != tp_only):
            continue
        for cp, pp in ((c, p) for c in divisors(ranks // tp) for p in divisors(ranks // (tp * c))):
            if (cp_only and cp != cp_only) or (not cp_only and cp > 1 and (w.seq < LONG or w.seq < 4 * cp)):
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
                for v, ep in ((v, ep) for v in _chunks(w, pp, micro, schedule, virtual) for ep in _eps(w, dp, ep_only)):
                    for seq in (sp if tp > 1 else (False,)):
                        for zero in (zeros if dp * cp > 1 else (0,)):
                            for recompute in recomputes:
                                yield Layout(tp, pp, dp, b, seq, zero, recompute, v, cp=cp, ep=ep)


def _eps(w: Workload, dp: int, ep_only: int | None) -> list[int]:
    """Expert-parallel sizes to try: divisors of dp up to the experts (1 for a dense model)."""
    if not w.experts:
        return [1]
    return [e for e in divisors(dp) if e <= w.experts and (not ep_only or e == ep_only)]


def _chunks(w: Workload, pp: int, micro: int, schedule: str | None, virtual: int | None) -> list[int]:
    """Model chunks per stage to try: 1 (1F1B), and v (interleaved: 2, or `virtual`) where it runs."""
    v = virtual or 2
    interleaves = pp > 1 and micro % pp == 0 and w.n_layer >= v * pp
    if schedule == "interleaved" or virtual:
        return [v] if interleaves else []
    if schedule == "1f1b":
        return [1]
    return [1, v] if interleaves else [1]


def plan(m, w: Workload, nodes: int, top: int = 10, max_tp: int | None = None, tp: int | None = None,
         pp: int | None = None, **allowed) -> dict:
    """allowed: candidates()'s micro_only, sp, zeros, recomputes, cp_only, schedule, virtual, even_stages, ep_only."""
    ranks = nodes * m.ranks_per_node
    rows = [price(m, w, lay) for lay in candidates(w, ranks, m.ranks_per_node, max_tp, tp, pp, **allowed)]
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: r["time"]["total"])
    return {"machine": m.name, "ranks": ranks, "workload": w, "ranked": fitting[:top], "all": rows,
            "why": explain(fitting, rows, m)}


def price(m, w: Workload, lay: Layout) -> dict:
    """One layout's row: its step time and parts, memory per rank, whether it fits, the FLOP/s it achieves."""
    mem = memory_per_rank(m, w, lay)
    t = step_time(m, w, lay)
    return {"layout": lay, "time": t, "memory": mem, "fits": mem["total"] <= m.mem_bytes,
            "achieved": achieved(m, w, lay, t["total"])}


def _ranks(n: int) -> str:
    return f"{n} rank{'s' * (n != 1)}"


def _where(t: dict, lay: Layout) -> str:
    """Which links the layout's groups cross, in words."""
    links = t["links"]
    sizes = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp * lay.cp}
    names = {"tp": "tensor-parallel groups", "cp": "context-parallel rings", "pp": "pipeline hops",
             "dp": "gradient reductions"}
    used = [k for k in ("tp", "cp", "pp", "dp") if sizes[k] > 1]
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
                    ("total", "micro_batches", "dp_hidden")), key=lambda kv: -kv[1])

    def sec(x: float) -> str:       # seconds, or ms for a laptop-sized step, as the table's time columns
        return f"{x:.3f} s" if t["total"] >= 0.1 else f"{1e3 * x:.3f} ms"

    lines = [f"best: {lay.describe()}, {sec(t['total'])} per step, {size_text(best['memory']['total'])} per rank; "
             "time goes to " + ", ".join(f"{k} {sec(v)}" for k, v in parts if v > 0)]
    lines.append(_where(t, lay))
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


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank parallel layouts by predicted step time and memory (cost model)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", default="dgx-a100",
                   help="a preset (dgx-2h, dgx-a100, dgx-h100) or a JSON file from `mpi-tp calibrate`")
    p.add_argument("--nodes", type=int, default=1)
    for flag in MODEL_FLAGS:                      # required, unless --legend is all that is asked
        p.add_argument(flag, type=int, default=None, help="the model: required (unless --legend alone)")
    p.add_argument("--vocab", type=int, default=51200)
    p.add_argument("--top", type=int, default=10, help="rows to show")
    p.add_argument("--max-tp", type=int, default=None, help="largest tensor-parallel size to consider")
    p.add_argument("--tp", type=int, default=None, help="consider only this tensor-parallel size")
    p.add_argument("--pp", type=int, default=None, help="consider only this number of pipeline stages")
    p.add_argument("--cp", type=int, default=None, help="consider only this context-parallel size (default: 1 "
                   f"below {LONG} positions, else any that leaves a rank at least 4 of each sequence)")
    p.add_argument("--micro-batch", type=int, default=None, help="consider only this micro-batch size")
    p.add_argument("--no-sp", action="store_true", help="leave out sequence parallelism")
    p.add_argument("--no-zero", action="store_true", help="leave out ZeRO-1")
    p.add_argument("--no-recompute", action="store_true", help="leave out activation recomputation")
    p.add_argument("--sp", action="store_true", help="only layouts with sequence parallelism (where tp > 1)")
    p.add_argument("--zero", type=int, choices=[0, 1], default=None, help="only ZeRO-1 (1) or only without it (0)")
    p.add_argument("--recompute", action="store_true", help="only layouts with full activation recomputation")
    p.add_argument("--schedule", choices=["1f1b", "interleaved"], default=None,
                   help="only this pipeline schedule (interleaved: chunks of --virtual-stages, default 2)")
    p.add_argument("--virtual-stages", type=int, default=None, help="only the interleaved schedule with this "
                   "many chunks per stage")
    p.add_argument("--experts", type=int, default=0, help="a mixture of experts: E experts in every --moe-every-th "
                   "block (default 0: dense)")
    p.add_argument("--top-k", type=int, default=1, help="with --experts: experts per token (default 1)")
    p.add_argument("--moe-every", type=int, default=1, help="with --experts: every N-th block is an MoE block")
    p.add_argument("--ep", type=int, default=None, help="with --experts: only this expert-parallel size (dividing dp)")
    p.add_argument("--explain", metavar="LAYOUT", default=None,
                   help="price one layout and print its terms, e.g. 'tp4 pp12 dp8 b2 +recompute' (as the table "
                        "writes layouts), whether or not it is among the top rows")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--legend", action="store_true",
                   help="explain every column of the table under it (alone, without the model: just the legend)")
    p.add_argument("--emit-config", metavar="FILE", default=None,
                   help="write the best layout as a config that `mpi-tp train --config FILE` runs (on a job "
                        "of that many ranks; the model trained is byte-level, vocabulary 256)")
    p.add_argument("--overwrite", action="store_true", help="replace the --emit-config file if it exists")
    p.set_defaults(run=cmd_plan, usage_error=p.error)


def _missing(args) -> list[str]:
    """The model's flags not given (argparse's names: --layers ...)."""
    return [flag for flag in MODEL_FLAGS if getattr(args, flag[2:].replace("-", "_")) is None]


def _check(args):
    for key in ("nodes", "layers", "hidden", "heads", "seq", "global_batch", "vocab", "top"):
        if getattr(args, key) < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1")
    for key in ("tp", "pp", "cp", "max_tp", "micro_batch", "virtual_stages"):       # pins: None is no pin
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    if args.hidden % args.heads:
        raise UserError(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}: every head has "
                        "hidden / heads channels")
    if args.experts < 0 or args.top_k < 1 or args.moe_every < 1:
        raise UserError("--experts must be >= 0, --top-k and --moe-every at least 1")
    if args.experts and (args.top_k > args.experts or args.moe_every > args.layers):
        raise UserError(f"--top-k {args.top_k} must be at most --experts {args.experts}, and --moe-every "
                        f"{args.moe_every} at most --layers {args.layers}")
    if args.ep is not None and (args.ep < 1 or not args.experts):
        raise UserError("--ep needs a mixture of experts (--experts E) and must be at least 1")
    if args.sp and args.no_sp or args.recompute and args.no_recompute or args.zero is not None and args.no_zero:
        raise UserError("a pin and its --no- form together (--sp / --no-sp, --zero / --no-zero, --recompute / "
                        "--no-recompute): give one")
    if args.virtual_stages and args.schedule == "1f1b":
        raise UserError("--virtual-stages needs the interleaved schedule (--schedule interleaved)")
    m = machine(args.machine)
    if args.nodes > 1 and args.machine not in PRESETS and (m.inter_alpha, m.inter_bw) == (m.intra_alpha, m.intra_bw):
        raise UserError(f"--nodes {args.nodes} with {args.machine}, whose network figures are its node's "
                        "(calibrated on one node: inter_alpha and inter_bw copied): calibrate across two nodes, or "
                        "write the network's alpha and bandwidth into inter_alpha and inter_bw")
    return m, Workload(args.layers, args.hidden, args.heads, args.seq, args.global_batch, args.vocab,
                       experts=args.experts, top_k=args.top_k, moe_every=args.moe_every)


def _allowed(args) -> dict:
    """candidates()'s settings from the command line's pins."""
    return dict(micro_only=args.micro_batch, cp_only=args.cp, schedule=args.schedule, virtual=args.virtual_stages,
                ep_only=args.ep,
                sp=(True,) if args.sp else (False,) if args.no_sp else (False, True),
                zeros=(args.zero,) if args.zero is not None else (0,) if args.no_zero else (0, 1),
                recomputes=(True,) if args.recompute else (False,) if args.no_recompute else (False, True))


def _empty(w: Workload, ranks: int, args) -> str:
    """Why no layout can be expressed."""
    pins = [f"--{k.replace('_', '-')} {v}" for k, v in (("tp", args.tp), ("cp", args.cp), ("pp", args.pp),
                                                         ("max_tp", args.max_tp), ("micro_batch", args.micro_batch),
                                                         ("virtual_stages", args.virtual_stages)) if v]
    return (f"no layout of {ranks} ranks can be expressed: tp x cp x pp x dp = {ranks} with tp at most the "
            f"{w.n_head} heads, pp at most the {w.n_layer} layers and dp dividing the global batch of "
            f"{w.global_batch}" + (f", under {' '.join(pins)}" if pins else "") + ": change the nodes, the "
            "batch or the pins")


LAYOUT_RE = re.compile(r"tp(\d+)(?: cp(\d+))? pp(\d+) dp(\d+)(?: ep(\d+))? b(\d+)((?: v\d+| \+sp| \+zero1| \+recompute| -overlap)*)")


def parse_layout(text: str, ranks: int) -> Layout:
    """A Layout from the table's way of writing it ('tp4 pp12 dp8 b2 v2 +sp +zero1 +recompute')."""
    got = LAYOUT_RE.fullmatch(" ".join(text.split()))
    if got is None:
        raise UserError(f"--explain {text!r}: write a layout as the table does, e.g. 'tp4 pp12 dp8 b2' or "
                        "'tp2 cp4 pp1 dp2 b1 v2 +sp +zero1 +recompute'")
    t, c, p, d, e, b = (int(x) if x else 1 for x in got.groups()[:6])
    flags = got.group(7).split()
    v = next((int(f[1:]) for f in flags if f.startswith("v")), 1)
    lay = Layout(t, p, d, b, "+sp" in flags, int("+zero1" in flags), "+recompute" in flags, v,
                 "-overlap" not in flags, cp=c, ep=e)
    if lay.ranks != ranks:
        raise UserError(f"--explain {text!r} has {lay.ranks} ranks, but the machine's {ranks}: pass --nodes "
                        "to match, or another layout")
    return lay


def explain_one(m, w: Workload, lay: Layout, result: dict) -> str:
    """One layout's terms: its row, each part of the step, memory, links, and where it ranks."""
    r = price(m, w, lay)
    t, mem = r["time"], r["memory"]
    ranked = [x["layout"] for x in sorted((x for x in result["all"] if x["fits"]), key=lambda x: x["time"]["total"])]
    where = (f"rank {ranked.index(lay) + 1} of the {len(ranked)} that fit" if lay in ranked else
             "not among the layouts searched (it is priced all the same)" if r["fits"] else "does not fit")
    lines = [f"{lay.describe()}: {t['total']:.4g} s per step, {size_text(mem['total'])} per rank "
             f"({'fits' if r['fits'] else 'over'} {m.mem_bytes / 1e9:.0f} GB); {where}; "
             f"{r['achieved']['flops_per_rank'] / 1e12:.1f} TFLOP/s per rank"]
    lines += [f"  {k:<13} {v:.4g} s" for k, v in t.items() if isinstance(v, float | int) and k != "total"]
    lines += [f"  memory {k:<10} {size_text(v)}" for k, v in mem.items() if k != "total"]
    lines.append("  " + _where(t, lay))
    return "\n".join(lines)


def train_config(w: Workload, lay: Layout) -> dict:
    """The options of `mpi-tp train` that run layout `lay` of workload `w` (JSON for --config)."""
    micro_batches = w.global_batch // (lay.dp * lay.micro_batch)
    return {"n_layer": w.n_layer, "n_head": w.n_head, "n_embd": w.n_embd, "block_size": w.seq,
            "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "batch_size": lay.micro_batch,
            "micro_batches": micro_batches, "schedule": "interleaved" if lay.virtual > 1 else "1f1b",
            "virtual_stages": lay.virtual, "sequence_parallel": lay.sp, "zero": lay.zero,
            "recompute": "full" if lay.recompute else "none",
            **({"moe_experts": w.experts, "moe_top_k": w.top_k, "moe_every": w.moe_every} if w.experts else {})}


def emit_config(path: str, w: Workload, lay: Layout) -> dict:
    """Write train_config(w, lay) to path, checked first as `mpi-tp train --config` will check it."""
    from mpi_tp.training.config import TrainConfig
    values = train_config(w, lay)
    TrainConfig(**values).validate(lay.ranks)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(values, f, indent=2)
    os.replace(tmp, path)
    return values


def cmd_plan(args, comm) -> int:
    from mpi_tp.core.runtime import collective_setup
    missing = _missing(args)
    if missing and args.legend and len(missing) == len(MODEL_FLAGS):
        if comm.Get_rank() == 0:
            print(legend())
        return 0
    if missing:
        message = f"the following arguments are required: {', '.join(missing)}"
        if getattr(args, "usage_error", None) is None:
            raise UserError(message)
        args.usage_error(message)                   # argparse's usage and one-line error, exit status 2
    m, w = collective_setup(_check, args, comm=comm)
    if args.emit_config:
        collective_setup(refuse_to_replace, args.emit_config, args.overwrite, "plan --emit-config", comm=comm)
    if comm.Get_rank():
        return 0
    result = plan(m, w, args.nodes, args.top, args.max_tp, args.tp, args.pp, **_allowed(args))
    if args.explain:
        print(explain_one(m, w, parse_layout(args.explain, result["ranks"]), result))
        return 0
    if not result["all"]:
        raise UserError(_empty(w, result["ranks"], args))
    if not result["ranked"]:
        raise UserError(result["why"])
    if args.emit_config:
        if not result["ranked"]:
            raise UserError(f"no layout fits, so there is no config to write: {result['why']}")
        best = result["ranked"][0]["layout"]
        emit_config(args.emit_config, w, best)
        print(f"wrote {args.emit_config}: {best.describe()}; run it with mpiexec -n {best.ranks} mpi-tp train "
              f"--config {args.emit_config}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"machine": m.name, "ranks": result["ranks"], "why": result["why"], "ranked": [
            {"layout": r["layout"].describe(), "seconds": r["time"], "memory_bytes": r["memory"],
             "achieved": r["achieved"]}
            for r in result["ranked"]]}, default=float))
        return 0
    print(table(m, w, args.nodes, result))
    print(legend() if args.legend else "(mpi-tp plan --legend explains every column)")
    print(result["why"])
    return 0
