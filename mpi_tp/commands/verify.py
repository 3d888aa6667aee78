"""`mpi-tp verify`: a layout's first training steps against the serial model, tensor by tensor.

    mpiexec -n 4 mpi-tp verify --tp 2 --dp 2 --zero 1 --dropout 0.1          # 3 steps, float64
    mpiexec -n 8 mpi-tp verify --tp 2 --pp 2 --dp 2 --micro-batches 2 --steps 5
    MPI_TP_FAILPOINT=bug-f-backward mpiexec -n 2 mpi-tp verify --tp 2        # a planted bug, found and named

Takes the options of `mpi-tp train` (the model, the layout, dropout, recomputation, micro-batches, the
optimizer, --init-from a checkpoint or a Hugging Face folder), runs --steps K steps (default 3) of that
layout and of the serial model side by side in float64, and prints one line per step. Exit status 0
when every step agrees within --tolerance, 1 at the first that does not, with the first layer whose
output differs and the first gradient (parameter, element, rank, shard) named.
"""
from __future__ import annotations

from mpi_tp.core.errors import UserError
from mpi_tp.core.failpoints import PLANTED
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.training.build import build_in_scratch
from mpi_tp.training.config_sources import add_arguments, resolve
from mpi_tp.verify.run import HEADER, verdict, verify_steps

STEPS = 3
TOLERANCE = 1e-9       # float64: layouts differ only in the order of their sums (a few ulps of 1e-16, grown by steps)


def add_parser(sub) -> None:
    v = sub.add_parser("verify", help="check a layout against the serial model, step by step, tensor by tensor",
                       description="Run a layout's first training steps beside the serial model, in float64, and "
                                   "compare the loss, every gradient and every parameter by name after each: "
                                   "mpiexec -n N mpi-tp verify [train's options]. Exit 0 when all agree; else "
                                   "the first step, layer and gradient (rank, shard, element) that differ, exit 1.",
                       epilog="planted bugs (MPI_TP_FAILPOINT=NAME): " +
                              "; ".join(f"{k}: {v}" for k, v in PLANTED.items()))
    add_arguments(v)
    v.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help=f"largest relative difference allowed (default {TOLERANCE:g})")
    v.set_defaults(run=run)


def _configure(args, world: int):
    """The run's configuration: train's, in float64, K steps, no run folder of its own."""
    if args.steps is None:
        args.steps = STEPS
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: verify at least one step")
    if not args.tolerance > 0:
        raise UserError(f"--tolerance {args.tolerance}: give a positive number, e.g. 1e-9")
    for flag, value in (("--out", args.out), ("--resume", args.resume), ("--trace", args.trace)):
        if value:
            raise UserError(f"{flag}: verify writes no run folder and resumes nothing (use --init-from to start "
                            "from a checkpoint)")
    args.dtype = args.dtype or "float64"
    cfg = resolve(args, world)
    if cfg.dtype != "float64" or cfg.precision != "fp32":
        raise UserError("verify compares in float64, where every layout gives the serial model's numbers to "
                        "rounding: drop --dtype and --precision")
    cfg.layout(world)                     # a layout that does not fit the world: its one line, now
    return cfg


def run(args, comm) -> int:
    world = comm.Get_size()
    cfg = collective_setup(_configure, args, world, comm=comm)
    job = build_in_scratch(cfg, comm, "mpi-tp-verify-")
    rank0_print(f"verify: {job.topo.layout.describe()} on {world} rank{'s' * (world > 1)} against the serial model, "
                f"{cfg.steps} step{'s' * (cfg.steps > 1)}, float64, tolerance {args.tolerance:g}"
                f"{', from ' + cfg.init_from if cfg.init_from else ''}\n{HEADER}", comm=comm)
    try:
        results = verify_steps(job, cfg.steps, args.tolerance, say=lambda line: rank0_print(line, comm=comm))
    finally:
        job.topo.free()
    rank0_print(verdict(results, args.tolerance), comm=comm)
    return 0 if results[-1].ok else 1
