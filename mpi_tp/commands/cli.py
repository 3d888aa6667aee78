"""The `mpi-tp` command (also `python -m mpi_tp`).

    mpiexec -n 2 mpi-tp train [--option value ...]     train (tensor-parallel over all ranks)
    mpi-tp train --help                                 every option, with its default
    mpiexec -n 2 mpi-tp eval --checkpoint C --data F    loss of a saved model on a text file
    mpiexec -n 2 mpi-tp generate --checkpoint C         sample text from a saved model
    mpiexec -n 2 mpi-tp serve --checkpoint C            an HTTP completions API (OpenAI-style)
    mpi-tp inspect C / mpi-tp export C OUT.h5           look into / flatten a checkpoint
    mpi-tp compare RUN_A RUN_B                          loss curves, tensors and next-token KL side by side
    mpi-tp export C OUT --format hf                     a Hugging Face GPT-2 folder (transformers loads it)
    mpiexec -n 2 mpi-tp import-hf HF_FOLDER OUT         a Hugging Face GPT-2 folder as a sharded checkpoint
    mpiexec -n 2 mpi-tp bench --shape c                 timed steps against the machine's limits
    mpi-tp plan --machine dgx-a100 --nodes 4 ...        rank layouts with the cost model
    mpiexec -n 2 mpi-tp calibrate --out machine.json    measure this machine for the cost model
    mpiexec -n 2 mpi-tp explain --layer mlp             a live lesson: one layer split over the ranks
    mpiexec -n 2 mpi-tp explain --layer pipeline        the pipeline schedules, drawn from their own run
    mpiexec -n 2 mpi-tp exercise 1 --file exercise1.py  an exercise: fix a broken layer, checked (--list)

The commands that run training steps (train, bench) ask glibc to keep freed memory
(mpi_tp.core.runtime.keep_freed_memory; MPI_TP_MALLOC=system, or the user's own MALLOC_*
settings, leave glibc as it is).

Errors in the input (options, config files, data files, layouts) print one
message from rank 0 and exit with status 2 on every rank; a crash on any rank
aborts the whole job (see mpi_tp.core.runtime).
"""
from __future__ import annotations

import argparse
import sys

from mpi4py import MPI

from mpi_tp import __version__
from mpi_tp.core import runtime

COMM = MPI.COMM_WORLD
runtime.limit_blas_threads(COMM)      # before NumPy loads its BLAS (the imports below)

from mpi_tp.core import blas  # noqa: E402
from mpi_tp.core.runtime import (  # noqa: E402
    UserError,
    check_world_size,
    collective_setup,
    install_abort_hook,
)
from mpi_tp.training.config_sources import add_arguments, resolve  # noqa: E402


class Parser(argparse.ArgumentParser):
    """argparse that speaks from rank 0 only (every rank parses the same argv)."""

    def _print_message(self, message, file=None):
        if COMM.Get_rank() == 0:
            super()._print_message(message, file)


def build_parser() -> Parser:
    p = Parser(prog="mpi-tp", description="Megatron-style tensor-parallel GPT training with NumPy/CuPy and MPI.")
    p.add_argument("--version", action="version", version=f"mpi_tp {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    t = sub.add_parser("train", help="train a byte-level GPT, tensor-parallel over all MPI ranks",
                       description="Train a byte-level GPT with tensor parallelism over all ranks: "
                                   "mpiexec -n T mpi-tp train [options]. Options override --config.")
    add_arguments(t)
    t.set_defaults(run=_train)
    from mpi_tp.commands.checkpoints import add_parsers as add_checkpoints
    add_checkpoints(sub)
    from mpi_tp.commands.compare import add_parser as add_compare
    add_compare(sub)
    from mpi_tp.commands.hf import add_parser as add_import_hf
    add_import_hf(sub)
    from mpi_tp.commands.serve import add_parser as add_serve
    add_serve(sub)
    from mpi_tp.commands.bench import add_parser as add_bench
    add_bench(sub)
    from mpi_tp.commands.plan import add_parser as add_plan
    add_plan(sub)
    from mpi_tp.planning.calibrate import add_parser as add_calibrate
    add_calibrate(sub)
    from mpi_tp.commands.explain import add_parser as add_explain
    add_explain(sub)
    from mpi_tp.commands.verify import add_parser as add_verify
    add_verify(sub)
    from mpi_tp.commands.exercise import add_parser as add_exercise
    add_exercise(sub)
    from mpi_tp.commands.tokenize import add_parser as add_tokenize
    add_tokenize(sub)
    return p


def _train(args, comm) -> int:
    from mpi_tp.training.loop import train
    runtime.keep_freed_memory()           # the command's process, not the library's: see its docstring
    cfg = collective_setup(resolve, args, comm.Get_size(), comm=comm)
    train(cfg, comm)
    return 0


def main(argv=None) -> int:
    install_abort_hook(COMM)
    args = build_parser().parse_args(argv)
    try:
        check_world_size(COMM)
        collective_setup(blas.check, comm=COMM)      # a bad MPI_TP_BLAS: one message at start, whatever the command
        return args.run(args, COMM)
    except UserError as e:
        if COMM.Get_rank() == 0:
            print(f"mpi-tp: error: {e}", file=sys.stderr, flush=True)
        return e.status
    except BrokenPipeError:               # `mpi-tp inspect ... | head`: the reader left; not an error
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
