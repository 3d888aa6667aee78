"""`mpi-tp plan`: the command line of the planner (mpi_tp.planning.planner searches, this file asks and answers).

    mpi-tp plan --machine dgx-a100 --nodes 4 --layers 48 --hidden 6144 --heads 48 --seq 2048 --global-batch 512
    mpi-tp plan ... --tp 8 --pp 12 --recompute                 # pins: any published layout's own row
    mpi-tp plan ... --explain 'tp4 pp12 dp8 b2 +recompute'     # one layout, term by term
    mpi-tp plan ... --emit-config best.json                    # the winner as a config `mpi-tp train` runs
    mpi-tp plan ... --precision bf16                           # values, wire bytes and state at bf16's width
    mpi-tp plan ... --moe-experts 8 --moe-top-k 2 [--ep 4 --etp 1 --moe-dispatcher allgather]   # experts
    mpi-tp plan ... --arch llama --n-kv-head 8 --intermediate-size 14336    # Llama's shape (plan_shape)
    mpi-tp plan --model PATH --global-batch 512                # the shape of a config.json or a checkpoint

Every bad input is one line and exit 2 (checked before anything is searched); an empty search says
what could not be expressed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

from mpi_tp.core.errors import UserError, refuse_to_replace
from mpi_tp.parallel.layout import Layout
from mpi_tp.commands.plan_moe import add_moe_arguments, check_moe
from mpi_tp.commands.plan_shape import add_shape_arguments, apply_model, check_shape
from mpi_tp.planning.bubble import ZERO_BUBBLE
from mpi_tp.planning.costmodel import Plan, Workload
from mpi_tp.planning.machines import PRESETS, machine, state_bytes, with_precision
from mpi_tp.planning.plan_table import legend, size_text, table
from mpi_tp.planning.planner import CP_POSITIONS, SCHEDULES, links_text, plan, price

MODEL_FLAGS = ("--layers", "--hidden", "--heads", "--seq", "--global-batch")     # the model: required


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank parallel layouts by predicted step time and memory (cost model)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", default="dgx-a100",
                   help="a preset (dgx-2h, dgx-a100, dgx-h100) or a JSON file from `mpi-tp calibrate`")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="the number format trained in, as `mpi-tp train --precision`: bytes per value (activations, "
                        "collectives) and the model state per parameter (fp32: 4 + 4 + 8 bytes; bf16, fp16: 2 + 2 + "
                        "12, the fp32 masters and moments, ZeRO-1 sharding the 12); default: the machine's own "
                        "(presets: Megatron's bf16 with fp32 gradients, 18 bytes; calibrated: fp32)")
    for flag in MODEL_FLAGS:                      # required, unless --legend is all that is asked
        p.add_argument(flag, type=int, default=None, help="the model: required (unless --legend alone, or "
                       "given by --model)")
    p.add_argument("--vocab", type=int, default=None, help="the vocabulary (default: --model's, else 51200)")
    add_shape_arguments(p)
    p.add_argument("--top", type=int, default=10, help="rows to show")
    p.add_argument("--max-tp", type=int, default=None, help="largest tensor-parallel size to consider")
    p.add_argument("--tp", type=int, default=None, help="consider only this tensor-parallel size")
    p.add_argument("--pp", type=int, default=None, help="consider only this number of pipeline stages")
    p.add_argument("--cp", type=int, default=None, help="consider only this context-parallel size (default: any "
                   f"that leaves each rank at least {CP_POSITIONS} positions of a sequence)")
    p.add_argument("--micro-batch", type=int, default=None, help="consider only this micro-batch size")
    p.add_argument("--no-sp", action="store_true", help="leave out sequence parallelism")
    p.add_argument("--no-zero", action="store_true", help="leave out ZeRO (stages 1 to 3)")
    p.add_argument("--no-recompute", action="store_true", help="leave out activation recomputation")
    p.add_argument("--sp", action="store_true", help="only layouts with sequence parallelism (where tp > 1)")
    p.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                   help="only this ZeRO stage (0: none; 1: optimizer state, 2: and gradients, 3: and parameters "
                        "sharded over dp x cp)")
    p.add_argument("--recompute", action="store_true", help="only layouts with full activation recomputation")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="only this pipeline schedule (interleaved: chunks of --virtual-stages, default: each chunk "
                        "size tried; zb-h1, zb-v: the zero-bubble schedules, B and W apart; zb-v two chunks per rank "
                        "in a V)")
    p.add_argument("--virtual-stages", type=int, default=None, help="only the interleaved schedule, this many chunks a stage")
    add_moe_arguments(p)
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
    if args.vocab is None:
        args.vocab = 51200
    for key in ("nodes", "layers", "hidden", "heads", "seq", "global_batch", "vocab", "top"):
        if getattr(args, key) < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1")
    for key in ("tp", "pp", "cp", "max_tp", "micro_batch", "virtual_stages"):       # pins: None is no pin
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    if args.hidden % args.heads:
        raise UserError(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}: every head has "
                        "hidden / heads channels")
    moe, shape = check_moe(args), check_shape(args)
    if args.sp and args.no_sp or args.recompute and args.no_recompute or args.zero is not None and args.no_zero:
        raise UserError("a pin and its --no- form together (--sp / --no-sp, --zero / --no-zero, --recompute / "
                        "--no-recompute): give one")
    if args.virtual_stages and args.schedule not in (None, "interleaved"):
        raise UserError("--virtual-stages needs the interleaved schedule (--schedule interleaved; zb-v always has "
                        "two chunks per rank)")
    m = machine(args.machine)
    if args.precision:
        m = with_precision(m, args.precision)
    ranks, pinned = args.nodes * m.ranks_per_node, (args.tp or 1) * (args.cp or 1) * (args.pp or 1)
    if ranks % pinned:                 # the world-size rule's own message (dp, or tp, takes the rest)
        Layout.resolve(ranks, tp=args.tp or 0, cp=args.cp or 1, pp=args.pp or 1, dp=0 if args.tp else 1)
    return m, Workload(args.layers, args.hidden, args.heads, args.seq, args.global_batch, args.vocab,
                       attention=args.attention, **moe, **shape)


def _allowed(args) -> dict:
    """candidates()'s settings from the command line's pins."""
    return dict(micro_only=args.micro_batch, cp_only=args.cp, virtual=args.virtual_stages,
                schedules=(args.schedule,) if args.schedule else SCHEDULES,
                ep_only=args.ep, etp_only=args.etp, dispatcher=args.dispatcher, overlap_tp=args.overlap_tp,
                sp=(True,) if args.sp else (False,) if args.no_sp else (False, True),
                zeros=(args.zero,) if args.zero is not None else (0,) if args.no_zero else (0, 1, 2, 3),
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


LAYOUT_RE = re.compile(r"tp(\d+)(?: cp(\d+))? pp(\d+) dp(\d+)(?: ep(\d+))?(?: etp(\d+))? b(\d+)"
                       r"((?: v\d+| zb-h1| zb-v| \+sp| \+zero[0-3]| \+recompute| -overlap| \+tp-overlap"
                       r"| ends\d+/\d+)*)")


def parse_layout(text: str, ranks: int) -> Plan:
    """A Layout from the table's way of writing it ('tp4 pp12 dp8 b2 v2 +sp +zero1 +recompute', 'tp4 pp12 dp8 b2
    zb-v +zero3'); checked (a zero-bubble schedule needs pp > 1)."""
    got = LAYOUT_RE.fullmatch(" ".join(text.split()))
    if got is None:
        raise UserError(f"--explain {text!r}: write a layout as the table does, e.g. 'tp4 pp12 dp8 b2' or "
                        "'tp2 cp4 pp1 dp2 b1 v2 +sp +zero1 +recompute' or 'tp2 pp4 dp2 b1 zb-v +zero3'")
    t, c, p, d, e, x, b = (int(x) if x else 0 if i == 5 else 1 for i, x in enumerate(got.groups()[:7]))
    flags = got.group(8).split()
    zb = next((f for f in flags if f in ZERO_BUBBLE), None)
    v = 2 if zb == "zb-v" else next((int(f[1:]) for f in flags if f.startswith("v")), 1)
    zero = next((int(f[5:]) for f in flags if f.startswith("+zero")), 0)
    first, last = next((tuple(int(n) for n in f[4:].split("/")) for f in flags if f.startswith("ends")), (0, 0))
    lay = Plan(tp=t, cp=c, pp=p, dp=d, ep=e, etp=x, virtual=v, sp="+sp" in flags, zero=zero, micro_batch=b,
               recompute="+recompute" in flags, overlap_dp="-overlap" not in flags, schedule=zb,
               first_stage_layers=first, last_stage_layers=last, overlap_tp="+tp-overlap" in flags)
    wrong = lay.problems()
    if wrong:
        raise UserError(f"--explain {text!r}: " + "; ".join(wrong))
    if lay.ranks != ranks:
        raise UserError(f"--explain {text!r} has {lay.ranks} ranks, but the machine's {ranks}: pass --nodes "
                        "to match, or another layout")
    return lay


COUNTS = ("total", "micro_batches", "w_share")     # step_time's entries that are not a part of the step in seconds


def explain_one(m, w: Workload, lay: Plan, result: dict) -> str:
    """One layout's terms: its row, each part of the step, memory, links, and where it ranks."""
    r = price(m, w, lay)
    t, mem = r["time"], r["memory"]
    ranked = [x["layout"] for x in sorted((x for x in result["all"] if x["fits"]), key=lambda x: x["time"]["total"])]
    where = (f"rank {ranked.index(lay) + 1} of the {len(ranked)} that fit" if lay in ranked else
             "not among the layouts searched (it is priced all the same)" if r["fits"] else "does not fit")
    lines = [f"{lay.describe()}: {t['total']:.4g} s per step, {size_text(mem['total'])} per rank "
             f"({'fits' if r['fits'] else 'over'} {m.mem_bytes / 1e9:.0f} GB); {where}; "
             f"{r['achieved']['flops_per_rank'] / 1e12:.1f} TFLOP/s per rank"]
    lines += [f"  {k:<13} {v:.4g} s" for k, v in t.items() if isinstance(v, float | int) and k not in COUNTS]
    lines.append(f"  {'micro_batches':<13} {t['micro_batches']:g} per replica and step")   # a count, not seconds
    if lay.pp > 1:
        lines.append(f"  {'w_share':<13} {t['w_share']:.3f} of a stage's work is W, the weights' gradients "
                     f"({lay.schedule_name}: mpi_tp.planning.bubble)")
    lines += [f"  memory {k:<10} {size_text(v)}" for k, v in mem.items() if k != "total"]
    lines.append("  " + links_text(t, lay))
    return "\n".join(lines)


def train_config(w: Workload, lay: Plan) -> dict:
    """The options of `mpi-tp train` that run layout `lay` of workload `w` (JSON for --config)."""
    micro_batches = w.global_batch // (lay.dp * lay.micro_batch)
    return {"n_layer": w.n_layer, "n_head": w.n_head, "n_embd": w.n_embd, "block_size": w.seq,
            **shape_config(w), "tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "etp": lay.etp,
            "batch_size": lay.micro_batch,
            "micro_batches": micro_batches, "schedule": lay.schedule_name,
            "virtual_stages": lay.virtual, "sequence_parallel": lay.sp, "zero": lay.zero,
            "recompute": "full" if lay.recompute else "none",
            **({"first_stage_layers": lay.first_stage_layers, "last_stage_layers": lay.last_stage_layers}
               if lay.first_stage_layers or lay.last_stage_layers else {}),
            **({"moe_experts": w.experts, "moe_top_k": w.top_k, "moe_every": w.moe_every,
                "moe_shared_experts": w.shared_experts, "moe_dispatcher": lay.dispatcher,
                "moe_capacity": w.capacity} if w.experts else {})}


def shape_config(w: Workload) -> dict:
    """`mpi-tp train`'s shape options for w beyond GPT-2's defaults (arch, n_kv_head, intermediate_size, tying)."""
    out = {"intermediate_size": w.ffn} if w.ffn != 4 * w.n_embd or w.llama else {}
    if w.llama:
        out.update(arch="llama", n_kv_head=w.kv_heads, **{"tie_embeddings" if w.tied else "untie_embeddings": True})
    return out


def trainable(w: Workload, result: dict) -> tuple[Plan | None, list[str]]:
    """The fastest layout that fits and that `mpi-tp train` accepts (the planner prices schedules and ZeRO stages
    a build may not train yet), and the faster ones passed over, each with train's reason."""
    from mpi_tp.training.config import TrainConfig
    passed = []
    for r in sorted((r for r in result["all"] if r["fits"]), key=lambda r: r["time"]["total"]):
        try:
            TrainConfig(**train_config(w, r["layout"])).validate(r["layout"].ranks)
            return r["layout"], passed
        except UserError as e:
            passed.append(f"{r['layout'].describe()} ({e})")
    return None, passed


def emit_config(path: str, w: Workload, lay: Plan) -> dict:
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
    if args.model:
        collective_setup(apply_model, args, comm=comm)
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
        lay = dataclasses.replace(parse_layout(args.explain, result["ranks"]), dispatcher=args.dispatcher)
        print(explain_one(m, w, lay, result))
        return 0
    if args.nodes > 1 and args.machine not in PRESETS and (m.inter_alpha, m.inter_bw) == (m.intra_alpha, m.intra_bw):
        print(f"mpi-tp plan: note: {args.machine} was calibrated on one node: its network figures (inter_alpha, "
              "inter_bw) are copies of the node's, so the groups that cross nodes are priced as if the network "
              "were as fast as the node; calibrate across two nodes, or write the network's figures into the "
              "file", file=sys.stderr)
    if not result["all"]:
        raise UserError(_empty(w, result["ranks"], args))
    if not result["ranked"]:
        raise UserError(result["why"])
    if args.emit_config:
        best, passed = trainable(w, result)
        if best is None:
            raise UserError(f"none of the {len(passed)} layouts that fit is one `mpi-tp train` accepts "
                            f"(the first: {passed[0]}): pin another with --schedule, --zero or the sizes")
        if passed:
            print(f"mpi-tp plan: note: {len(passed)} faster layout(s) are priced but not trained by this build "
                  f"(the first: {passed[0]}); the config is the fastest it trains", file=sys.stderr)
        emit_config(args.emit_config, w, best)
        print(f"wrote {args.emit_config}: {best.describe()}; run it with mpiexec -n {best.ranks} mpi-tp train "
              f"--config {args.emit_config}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"machine": m.name, "ranks": result["ranks"], "why": result["why"],
                          "bytes_per_value": m.bytes_per_value, "state_bytes_per_param": state_bytes(m),
                          **({"moe": {**check_moe(args), "dispatcher": args.dispatcher}} if w.experts else {}),
                          "ranked": [
            {"layout": r["layout"].describe(), "seconds": r["time"], "memory_bytes": r["memory"],
             "achieved": r["achieved"]}
            for r in result["ranked"]]}, default=float))
        return 0
    print(table(m, w, args.nodes, result))
    print(legend() if args.legend else "(mpi-tp plan --legend explains every column)")
    print(result["why"])
    return 0
