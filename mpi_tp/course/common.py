"""What every exercise check shares: loading the student's file, comparing, counting, reporting.

A check runs on every rank of the job (T = world size). Each rank writes what it
finds into its `Feedback` (problems name the rank and the quantity; notes say why;
hints say what to look at); `finish` gathers them on rank 0, which prints the
report and PASS or FAIL. Student code that raises is caught and reported with
the line of the student's file it came from.
"""
from __future__ import annotations

import importlib.util
import numbers
import os
import re
import sys
import traceback

import numpy

from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.core.testing import all_true, max_rel_diff, randomize

RTOL = 1e-10              # float64: a correct parallel layer only reorders sums
SEED = 7
F64 = numpy.float64
B, S, C = 2, 4, 8         # the tiny layer of every check (O = K = 2C + 1, F = 4C)
MAX_T = 8                 # C = 8 channels: every rank needs at least one of them
_RANK = re.compile(r"\brank (\d+)\b")


def load(path: str, names: tuple[str, ...], label: str):
    """The module in the student's file at `path` (run as code, as the student wrote it), checked to
    define `names`; a UserError (exit 2) with one line says what is missing."""
    if not os.path.isfile(path):
        raise UserError(f"{label}: no such file: {path}")
    spec = importlib.util.spec_from_file_location(f"mpi_tp_exercise_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise UserError(f"{label}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 -- the student's file: a syntax error or a failing import is bad input
        line = getattr(e, "lineno", None) or _line_in(e, path)
        raise UserError(f"{label}: {path} does not load: {type(e).__name__}: {e}"
                        + (f" (line {line})" if line else "")) from None
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise UserError(f"{label}: {path} does not define {', '.join(missing)}: "
                        f"start from a fresh copy (mpi-tp exercise N --copy DIR)")
    return module


def load_everywhere(path: str, names: tuple[str, ...], label: str, comm):
    """`load` on every rank; if any rank fails, every rank raises the same UserError."""
    return collective_setup(load, path, names, label, comm=comm)


def _line_in(e: BaseException, path: str) -> int | None:
    """The last line of the student's file in e's traceback (None if it never got there)."""
    mine = os.path.realpath(path)
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == mine]
    return lines[-1] if lines else None


def needs_ranks(number: int, T: int, low: int = 2) -> None:
    if T < low:
        raise UserError(f"exercise {number} needs {low} or more ranks: at T = 1 nothing is communicated, so "
                        f"the bug it hides cannot show; run it with mpiexec -n 2 mpi-tp exercise {number} ...")
    if T > MAX_T:
        raise UserError(f"exercise {number} splits C = {C} channels: use at most {MAX_T} ranks, not {T}")


class Feedback:
    """What one rank found. problem: something wrong (fails the check); note: why, when the check could
    tell; hint: what to read or change; fact: what is right (printed on PASS)."""

    def __init__(self, rank: int, path: str | None = None):
        self.rank, self.path = rank, path
        self.problems, self.notes, self.hints, self.facts = [], [], [], []

    def problem(self, text: str, *, every_rank: bool = False) -> None:
        """A problem this rank found ('rank i: ...'); every_rank: a statement about all the ranks, unprefixed."""
        self.problems.append(text if every_rank else f"rank {self.rank}: {text}")

    def note(self, text: str) -> None:
        self.notes.append(text)

    def hint(self, text: str) -> None:
        self.hints.append(text)

    def attempt(self, what: str, fn, *args):
        """(fn(*args), True), or (None, False) with a problem naming the exception and the student's line."""
        try:
            return fn(*args), True
        except Exception as e:  # noqa: BLE001 -- the student's code: report it, do not crash the job
            line = _line_in(e, self.path) if self.path else None
            where = f" at line {line} of {os.path.basename(self.path)}" if line else ""
            self.problem(f"{what} raised {type(e).__name__}{where}: {e}")
            return None, False

    def predict(self, fn, name: str, args: tuple):
        """A prediction exercise's number: fn(*args), or None with a problem if it raised or is not a number."""
        value, ok = self.attempt(f"{name}{args}", fn, *args)
        if ok and not isinstance(value, numbers.Real):
            self.problems.append(f"{name}{args} returned {value!r}, not a number")
            return None
        return value

    def compare(self, what: str, actual, expected, scale: float | None = None) -> float:
        """Record a problem when `actual` is not the serial layer's `expected`; returns the error."""
        shape = getattr(actual, "shape", None)
        if shape != expected.shape:
            self.problem(f"{what} has shape {shape}, the serial layer's is {expected.shape}")
            return float("inf")
        err = max_rel_diff(actual, expected, scale)
        if not err <= RTOL:
            self.problem(f"{what}: max relative difference {err:.1e} from the serial layer (tolerance {RTOL:.0e})")
        return err

    def counters(self, phase: str, measured: dict, expected: dict, unit: int) -> None:
        """measured: a CommStats snapshot; expected: {key: (calls, bytes)}; unit: B S C itemsize."""
        got = {k: (v["calls"], v["bytes"]) for k, v in measured.items()}
        if got != expected:
            self.problem(f"{phase} collectives: {describe(got, unit)}; the right layer does "
                         f"{describe(expected, unit)}")


def describe(counts: dict, unit: int) -> str:
    """'tp/all_reduce: 1 call, 512 buffer bytes (1 B S C itemsize)', or 'none'."""
    if not counts:
        return "none"
    return ", ".join(f"{k}: {c} call{'s' * (c != 1)}, {n} buffer bytes ({n / unit:g} B S C itemsize)"
                     for k, (c, n) in sorted(counts.items()))


def _merge_ranks(texts: list[str], T: int) -> list[str]:
    """Lines that differ only in the rank they name become one: 'rank 0: x' and 'rank 1: x' give
    'ranks 0, 1: x' ('every rank: x' when every rank said it); duplicates are dropped."""
    groups: dict[str, list[int]] = {}
    for t in texts:
        m = _RANK.search(t)
        key = _RANK.sub("rank {}", t, count=1) if m else t
        ranks = groups.setdefault(key, [])
        if m and int(m.group(1)) not in ranks:
            ranks.append(int(m.group(1)))
    out = []
    for key, ranks in groups.items():
        if len(ranks) <= 1:
            out.append(key.replace("rank {}", f"rank {ranks[0]}", 1) if ranks else key)
        else:
            who = "every rank" if len(ranks) == T else "ranks " + ", ".join(map(str, sorted(ranks)))
            out.append(key.replace("rank {}", who, 1))
    return out


def build(make, seed: int = SEED):
    """make() with every parameter randomized (biases too), the same slice for slice at any T."""
    layer = make()
    randomize(layer, seed=seed)
    return layer


def finish(comm, number: int, title: str, fb: Feedback, hints: list[str] = (),
           against: str = "float64, against the serial layer built from the same seed", size: str = "T") -> bool:
    """Gather every rank's findings on rank 0, print the report, PASS or FAIL; True on every rank on PASS.

    `size`: the letter the world size stands for in this exercise (notation.md): T, or Z for the ring, D for
    the replicas."""
    ok = all_true(not fb.problems, comm)
    found = comm.gather((fb.problems, fb.notes, fb.hints, fb.facts), root=0)   # a report: pickled once
    if comm.Get_rank() == 0:
        def unique(i):
            longest = max(len(part[i]) for part in found)      # the j-th finding of every rank, then the next
            return _merge_ranks([part[i][j] for j in range(longest) for part in found if j < len(part[i])],
                                comm.Get_size())
        lines = [f"exercise {number}: {title}, at {size} = {comm.Get_size()} ({against})"]
        if ok:
            lines += [f"  {t}" for t in unique(3)] + ["PASS"]
        else:
            lines += [f"  {t}" for t in unique(0)] + [f"  why: {t}" for t in unique(1)]
            lines += [f"  hint: {t}" for t in unique(2) + [h for h in hints if h not in unique(2)]] + ["FAIL"]
        rank0_print("\n".join(lines), comm=comm)
    sys.stdout.flush()
    return ok
