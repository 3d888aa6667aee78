"""`mpi-tp exercise`: broken layers to fix and a prediction to make, checked with feedback.

    mpi-tp exercise --list                                   the exercises
    mpi-tp exercise 1 --copy DIR                             write DIR/exercise1.py, the broken layer
    mpiexec -n 2 mpi-tp exercise 1 --file DIR/exercise1.py   check your fix at T = 2
    mpiexec -n 2 mpi-tp exercise 1                           check the shipped broken version (FAIL)
    mpiexec -n 2 mpi-tp exercise 1 --solution                check the reference solution (PASS)

Each check runs the layer at T = world size against the serial layer built from
the same seed (float64), or a prediction against the counters, and prints PASS
or what is still wrong. Exit status 0 on PASS, 1 on FAIL, 2 on bad input. A
check that is still running after MPI_TP_EXERCISE_TIMEOUT seconds (default 120)
aborts the job with a message: a student's layer that raised, or skipped a
collective, on some ranks leaves the others waiting in one, which would hang.
"""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time

from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.course.common import load_everywhere, needs_ranks
from mpi_tp.course.registry import EXERCISES, get


def _watchdog(comm, seconds: float) -> threading.Timer:
    """A timer that aborts the whole job if the check has not ended by then (cancel it when it has)."""
    def fire():
        sys.stderr.write(f"[rank {comm.Get_rank()}] the check is still running after {seconds:.0f} s: the ranks "
                         "are out of step (did your code raise, or skip a collective, on some ranks only?); "
                         "aborting the job\n")
        sys.stderr.flush()
        time.sleep(1.0)            # the launcher forwards the message before the abort takes the job down
        comm.Abort(3)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def _last() -> int:
    """The highest exercise number (the numbers need not be consecutive)."""
    return max(e.number for e in EXERCISES)


def _exercise(number):
    if number is None:
        raise UserError("give an exercise number (mpi-tp exercise 1) or --list")
    try:
        found = get(int(number))
    except ValueError:
        found = None
    if found is None:
        raise UserError(f"no exercise {number}: choose 1 to {_last()} (mpi-tp exercise --list)")
    return found


def _copy(ex, folder: str, rank: int) -> str:
    """Write folder/exerciseN.py (rank 0 only); refuse to overwrite the student's work."""
    target = os.path.join(folder, f"exercise{ex.number}.py")
    if rank != 0:
        return target
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--copy {folder}: not a directory")
    if os.path.exists(target):
        raise UserError(f"{target} exists already: not overwriting it (delete it, or copy to another directory)")
    try:
        os.makedirs(folder, exist_ok=True)
        shutil.copyfile(ex.source(), target)
    except OSError as e:
        raise UserError(f"--copy {folder}: {e.strerror or e}") from None
    return target


def _list() -> str:
    lines = []
    for ex in EXERCISES:
        at_least = f"{ex.min_ranks} or more ranks" if ex.min_ranks > 1 else "any number of ranks"
        lines += [f"{ex.number}. {ex.title} ({at_least}): fix {' and '.join(ex.names)}",
                  (f"   mpi-tp exercise {ex.number} --copy DIR, then "
                   f"mpiexec -n {ex.ranks} mpi-tp exercise {ex.number} --file DIR/exercise{ex.number}.py"),
                  f"   lesson: {ex.lesson}"]
    return "\n".join(lines)


def cmd_exercise(args, comm) -> int:
    if args.list:
        rank0_print(_list(), comm=comm)
        return 0
    ex = collective_setup(_exercise, args.number, comm=comm)
    if args.copy is not None:
        target = collective_setup(_copy, ex, args.copy, comm.Get_rank(), comm=comm)
        rank0_print(f"wrote {target}: fix {' and '.join(ex.names)} there (the part marked EXERCISE {ex.number}), "
                    f"then check it:\n  mpiexec -n {ex.ranks} mpi-tp exercise {ex.number} --file {target}", comm=comm)
        return 0
    collective_setup(needs_ranks, ex.number, comm.Get_size(), ex.min_ranks, comm=comm)
    path = os.path.abspath(args.file) if args.file else ex.source(args.solution)
    if not args.file:
        which = "reference solution" if args.solution else "shipped broken version (expected to FAIL)"
        rank0_print(f"checking the {which}: {path}", comm=comm)
    student = load_everywhere(path, ex.names, f"exercise {ex.number}", comm)
    timer = _watchdog(comm, float(os.environ.get("MPI_TP_EXERCISE_TIMEOUT", "120")))
    try:
        return 0 if ex.check(student, comm, path) else 1
    finally:
        timer.cancel()


def add_parser(sub) -> None:
    e = sub.add_parser("exercise", help="exercises with feedback: fix a broken layer, predict the bytes of a step",
                       description=__doc__.split("\n\n")[0])
    e.add_argument("number", nargs="?", metavar="N", help=f"the exercise, 1 to {_last()}")
    e.add_argument("--list", action="store_true", help="list the exercises")
    how = e.add_mutually_exclusive_group()
    how.add_argument("--copy", nargs="?", const=".", metavar="DIR",
                     help="write exerciseN.py, the broken version to fix, into DIR (default: the current "
                          "directory; created if missing; an existing file is never overwritten)")
    how.add_argument("--file", metavar="FILE", help="check your edited file (default: the shipped broken version)")
    how.add_argument("--solution", action="store_true", help="check the reference solution")
    e.set_defaults(run=cmd_exercise)
