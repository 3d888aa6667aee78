"""`mpi-tp bench`: its options, the shapes they name, and which measurement runs them.

    OMP_NUM_THREADS=1 mpi-tp bench --shape c                  # T = 1, one BLAS thread
    mpiexec -n 2 mpi-tp bench --shape c --json out.jsonl      # T = 2, one thread per rank
    mpiexec -n 2 mpi-tp bench --sweep                         # step time against the work
    mpiexec -n 2 mpi-tp bench --dp 2 --precision bf16 --json out.jsonl   # bf16, fp32 masters: bytes at 2

Training steps: mpi_tp.commands.bench.step; --pp: bench.pipeline; --inference: bench.inference;
--moe: bench.moe. Bad options are one line on every rank before anything is measured (collective_setup).
"""
from __future__ import annotations

import json

from mpi_tp.commands.bench import accounting
from mpi_tp.commands.bench import inference as bench_inference
from mpi_tp.commands.bench import moe as bench_moe
from mpi_tp.commands.bench.pipeline import print_pipeline, run_pipeline_shape
from mpi_tp.commands.bench.step import SHAPES, print_table, run_shape
from mpi_tp.commands.bench.yardsticks import environment
from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.core.precision import precision
from mpi_tp.core.runtime import collective_setup, keep_freed_memory, rank0_print
from mpi_tp.model.config import GPTConfig
from mpi_tp.parallel.layout import RULE, Layout
from mpi_tp.parallel.pipeline.schedules import SCHEDULES, V_SHAPED, schedule
from mpi_tp.parallel.pipeline.stages import layer_ranges


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="time training steps against this machine's GEMM and MPI limits",
                       description=__doc__.split("\n\n")[0])
    b.add_argument("--shape", choices=sorted(SHAPES), action="append",
                   help="a preset (repeatable): a: 256/4/4/128/8, b: 512/8/4/128/8, c: 1024/16/2/128/4 "
                        "(C/heads/layers/seq/batch); default a, b, c")
    b.add_argument("--custom", metavar="C,H,L,S,B", action="append", default=[],
                   help="a shape of your own (repeatable): channels, heads, layers, sequence, batch")
    b.add_argument("--sweep", action="store_true", help="sweep hidden size and sequence length instead")
    b.add_argument("--steps", type=int, default=10, help="timed steps per shape (default 10)")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    b.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    b.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16 / fp16: the model in bfloat16 / float16 with fp32 masters and moments (as `mpi-tp "
                        "train --precision`, fp16 with its loss scale); --json reports activation bytes, wire "
                        "bytes and memory per rank at that width")
    b.add_argument("--fp32-grads", action="store_true",
                   help="with --precision bf16/fp16: gradients accumulated and reduced in fp32 (as `mpi-tp train "
                        "--fp32-grads`); --json's wire_bytes_by_role.grad_reduce_dtype says float32")
    b.add_argument("--tp", type=int, default=0, help=f"tensor-parallel size (0: ranks / (cp * pp * dp); {RULE})")
    b.add_argument("--dp", type=int, default=1, help="data-parallel replicas; batch is per replica")
    b.add_argument("--dp-compare", action="store_true",
                   help="with --dp > 1: run each shape three times, gradient all-reduce during the backward "
                        "(overlap), after it, and not at all (baseline), to show what it adds to a step")
    b.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism")
    b.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks, "
                   "ring attention")
    b.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0,
                   help="1: with --dp > 1, the distributed optimizer (ZeRO-1); 2, 3: ZeRO-2 / ZeRO-3 where "
                        "the layout has them")
    b.add_argument("--pp", type=int, default=1, help="pipeline stages; with "
                   "--micro-batches, --schedule, --virtual-stages; batch is per micro-batch")
    b.add_argument("--micro-batches", type=int, default=4, help="with --pp: micro-batches per step (default 4)")
    b.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    b.add_argument("--virtual-stages", type=int, default=1, help="with --schedule interleaved: chunks per stage")
    b.add_argument("--first-stage-layers", type=int, default=0, help="with --pp: blocks on the first stage "
                   "(0: an even share), as `mpi-tp train --first-stage-layers`")
    b.add_argument("--last-stage-layers", type=int, default=0, help="with --pp: blocks on the last stage "
                   "(0: an even share), as `mpi-tp train --last-stage-layers`")
    b.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation (--json's memory_measured: the step's peak by category)")
    b.add_argument("--backend", choices=["numpy", "cupy"], default="numpy", help="array backend (cupy: GPUs)")
    bench_inference.add_arguments(b)
    bench_moe.add_arguments(b)
    b.add_argument("--json", metavar="FILE", help="append one JSON line per shape to FILE")
    b.set_defaults(run=cmd_bench)


def _shapes(args, ranks: int) -> list[tuple]:
    """The shapes to run, each checked against the layout before anything starts."""
    if args.sweep:
        shapes = [(C, max(1, C // 64), 2, S, 4) for C in (128, 256, 512, 1024) for S in (64, 128, 256, 512)]
    else:
        custom = []
        for text in args.custom:
            try:
                C, H, L, S, B = (int(v) for v in text.split(","))
            except ValueError:
                raise UserError(f"--custom {text!r}: give five integers C,H,L,S,B, e.g. 2048,16,2,64,2") from None
            custom.append((C, H, L, S, B))
        presets = args.shape or ([] if custom else ["a", "b", "c"])
        shapes = [SHAPES[s] for s in presets] + custom
    if args.steps < 1 or args.warmup < 0:
        raise UserError("--steps must be at least 1 and --warmup at least 0")
    if args.tp < 0:
        raise UserError(f"--tp must be at least 0 (0: what cp x pp x dp leave), got {args.tp}")
    accounting.check_precision(args)
    args.layout = Layout.resolve(ranks, tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp, zero=args.zero,
                                 sp=args.sequence_parallel, virtual=args.virtual_stages)
    if args.cp > 1 and (args.pp > 1 or args.inference or args.moe):
        raise UserError("--cp times training steps without pipeline stages (drop --pp, --inference, --moe)")
    if args.first_stage_layers < 0 or args.last_stage_layers < 0:
        raise UserError("--first-stage-layers and --last-stage-layers must be >= 0 (0: an even share)")
    if args.pp > 1:
        if args.micro_batches < 1 or args.virtual_stages < 1:
            raise UserError("--micro-batches and --virtual-stages must be at least 1")
        schedule(args.schedule, args.pp, args.micro_batches, args.virtual_stages)     # checks the combination
    tp = args.layout.tp
    for C, H, L, S, B in shapes:
        if S < 2 * args.cp:
            raise UserError(f"--cp {args.cp} cuts each sequence into {2 * args.cp} chunks: S = {S} is too short")
        if B < 1:
            raise UserError(f"batch must be at least 1, got {B}")
        GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S).validate(tp)
        if L < args.pp * args.virtual_stages:
            raise UserError(f"{L} layers cannot fill {args.pp} stages x {args.virtual_stages} chunks")
        if args.first_stage_layers or args.last_stage_layers:          # the pipeline's rule and its message
            layer_ranges(L, args.pp, args.virtual_stages, args.schedule in V_SHAPED,
                         args.first_stage_layers or None, args.last_stage_layers or None)
    return shapes


def cmd_bench(args, comm) -> int:
    if (args.inference or args.moe) and not args.shape and not args.custom:
        args.shape = ["a" if args.moe else "c"]
    shapes = collective_setup(_shapes, args, comm.Get_size(), comm=comm)
    if args.inference:
        collective_setup(bench_inference.check, args, shapes, comm=comm)
    if args.moe:
        collective_setup(bench_moe.check, args, comm.Get_size(), comm=comm)
    collective_setup(backend.use, args.backend, comm, comm=comm)
    keep_freed_memory()                                  # the command's process (runtime.keep_freed_memory)
    env = environment(comm)
    rank0_print(f"{env['cpu']}, {env['cores']} cores; BLAS {env['blas']}, linear layers' GEMMs by {env['gemm']}; "
                f"{env['threads_per_rank']} thread(s) "
                f"per rank; {env['ranks']} rank(s); {env['mpi']}; numpy {env['numpy']}; "
                f"{' '.join(f'{k}={v}' for k, v in env['malloc'].items()) or 'malloc defaults'}; {env['date']}",
                comm=comm)
    if args.inference:
        return bench_inference.cmd_inference(args, comm, shapes, env)
    if args.moe:
        return bench_moe.cmd_moe(args, comm, shapes, env)
    modes = ["overlap", "after", "none"] if args.dp_compare else ["overlap"]
    dtype = args.dtype if args.precision == "fp32" else precision(args.precision).dtype
    for C, H, L, S, B in shapes:
        if args.pp > 1:
            r = run_pipeline_shape(comm, C, H, L, S, B, args.steps, args.warmup, args.dtype,
                                   args.layout.tp, args.pp, args.dp, args.micro_batches,
                                   args.schedule, args.virtual_stages, args.sequence_parallel,
                                   recompute=args.recompute, overlap_dp=True, zero=args.zero,
                                   first_stage_layers=args.first_stage_layers or None,
                                   last_stage_layers=args.last_stage_layers or None)
            r["environment"] = env
            rank0_print(print_pipeline(r), comm=comm)
            if args.json and comm.Get_rank() == 0:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
            continue
        for mode in modes:
            r = run_shape(comm, C, H, L, S, B, args.steps, args.warmup, dtype, dp=args.dp, dp_mode=mode,
                          sequence_parallel=args.sequence_parallel, zero=args.zero, cp=args.cp,
                          tp=args.layout.tp, fp32_grads=args.fp32_grads, recompute=args.recompute)
            r["environment"] = env
            print_table(r, comm)
            if args.json and comm.Get_rank() == 0:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    return 0
