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
import sys

from mpi_tp.core.errors import UserError, refuse_to_replace
from mpi_tp.planning.costmodel import Layout, Workload, achieved, step_time
from mpi_tp.planning.machines import machine
from mpi_tp.planning.memory import memory_per_rank
from mpi_tp.planning.plan_table import legend, size_text, table

MODEL_FLAGS = ("--layers", "--hidden", "--heads", "--seq", "--global-batch")     # the model: required


LONG = 8192        # context parallelism is considered from this sequence length on (or asked for: --cp)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(w: Workload, ranks: int, per_node: int, max_tp: int | None = None, tp_only: int | None = None,
               pp_only: int | None = None, micro_only: int | None = None, sp=(False, True), zeros=(0, 1),
               recomputes=(False, True), cp_only: int | None = None):
    """Layouts to price: tp up to the heads (and max_tp), cp > 1 for sequences of LONG positions or more
    (what context parallelism is for; at least 4 positions per rank), pp dividing the layers, dp the rest (tp_only / cp_only / pp_only / micro_only: just that
    size; sp, zeros, recomputes: the settings allowed)."""
    for tp in divisors(ranks):
        if tp > w.n_head or (max_tp and tp > max_tp) or (tp_only and tp != tp_only):
            continue
        for cp, pp in ((c, p) for c in divisors(ranks // tp) for p in divisors(ranks // (tp * c))):
            if (cp_only and cp != cp_only) or (not cp_only and cp > 1 and (w.seq < LONG or w.seq < 4 * cp)):
                continue
            if w.n_layer % pp or (pp_only and pp != pp_only):
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
                chunks = [1, 2] if pp > 1 and micro % pp == 0 and w.n_layer % (2 * pp) == 0 else [1]
                for seq in (sp if tp > 1 else (False,)):
                    for zero in (zeros if dp > 1 else (0,)):
                        for recompute in recomputes:
                            for virtual in chunks:          # the interleaved schedule where it applies
                                yield Layout(tp, pp, dp, b, seq, zero, recompute, virtual, cp=cp)


def plan(m, w: Workload, nodes: int, top: int = 10, max_tp: int | None = None, tp: int | None = None,
         pp: int | None = None, **allowed) -> dict:
    """allowed: candidates()'s micro_only, sp, zeros, recomputes."""
    ranks = nodes * m.ranks_per_node
    rows = []
    for lay in candidates(w, ranks, m.ranks_per_node, max_tp, tp, pp, **allowed):
        mem = memory_per_rank(m, w, lay)
        t = step_time(m, w, lay)
        rows.append({"layout": lay, "time": t, "memory": mem, "fits": mem["total"] <= m.mem_bytes,
                     "achieved": achieved(m, w, lay, t["total"])})
    fitting = sorted((r for r in rows if r["fits"]), key=lambda r: r["time"]["total"])
    return {"machine": m.name, "ranks": ranks, "workload": w, "ranked": fitting[:top], "all": rows,
            "why": explain(fitting, rows, m)}


def explain(fitting, rows, m) -> str:
    if not fitting:
        smallest = min(rows, key=lambda r: r["memory"]["total"]) if rows else None
        need = size_text(smallest['memory']['total']) if smallest else "?"
        return (f"no layout fits in {m.mem_bytes / 1e9:.0f} GB per rank (the smallest needs {need}): "
                "use more nodes, or a machine with more memory")
    best = fitting[0]
    lay, t = best["layout"], best["time"]
    parts = sorted(((k, v) for k, v in t.items() if k not in ("total", "micro_batches", "dp_hidden")), key=lambda kv: -kv[1])

    def sec(x: float) -> str:       # seconds, or ms for a laptop-sized step, as the table's time columns
        return f"{x:.3f} s" if t["total"] >= 0.1 else f"{1e3 * x:.3f} ms"

    lines = [f"best: {lay.describe()}, {sec(t['total'])} per step, {size_text(best['memory']['total'])} per rank; "
             "time goes to " + ", ".join(f"{k} {sec(v)}" for k, v in parts if v > 0)]
    lines.append(f"its tensor-parallel groups ({lay.tp} ranks) " + ("stay inside a node." if lay.tp <= m.ranks_per_node
                 else "span nodes: their all-reduces cross the network."))
    others = [r for r in fitting if r["layout"].tp != lay.tp]
    if others:
        o = others[0]
        ol, ot = o["layout"], o["time"]
        diff = ot["total"] - t["total"]
        reason = []
        if ot["tp_comm"] > t["tp_comm"]:
            crossing = " (its groups cross the network)" if ol.tp > m.ranks_per_node else ""
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
    m = machine(args.machine)
    for key in ("nodes", "layers", "hidden", "heads", "seq", "global_batch", "vocab", "top"):
        if getattr(args, key) < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1")
    return m, Workload(args.layers, args.hidden, args.heads, args.seq, args.global_batch, args.vocab)


def train_config(w: Workload, lay: Layout) -> dict:
    """The options of `mpi-tp train` that run layout `lay` of workload `w` (JSON for --config)."""
    micro_batches = w.global_batch // (lay.dp * lay.micro_batch)
    return {"n_layer": w.n_layer, "n_head": w.n_head, "n_embd": w.n_embd, "block_size": w.seq,
            "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "batch_size": lay.micro_batch,
            "micro_batches": micro_batches, "schedule": "interleaved" if lay.virtual > 1 else "1f1b",
            "virtual_stages": lay.virtual, "sequence_parallel": lay.sp, "zero": lay.zero,
            "recompute": "full" if lay.recompute else "none"}


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
    result = plan(m, w, args.nodes, args.top, args.max_tp, args.tp, args.pp, micro_only=args.micro_batch,
                  cp_only=args.cp,
                  sp=(False,) if args.no_sp else (False, True), zeros=(0,) if args.no_zero else (0, 1),
                  recomputes=(False,) if args.no_recompute else (False, True))
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
