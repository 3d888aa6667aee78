"""A mutant: one small break of one mechanism, and the tests (with their world sizes) that must catch it.

The lists live beside this file, one module per concern (AREAS), each a MUTANTS list. A mutant names
the text it replaces, which must occur exactly once in its file: when the code moves on, the check
says which mutant went stale instead of mutating something else.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]          # the repository
AREAS = ("regions", "sequence", "layouts", "data_parallel", "pipeline", "context", "attention", "moe", "recompute", "inference",
         "checkpoint", "precision", "zero", "build", "verify")


@dataclass(frozen=True)
class Mutant:
    name: str                  # "area/what", unique
    breaks: str                # the mechanism it breaks, in words
    file: str                  # relative to the repository
    old: str                   # text that occurs exactly once in file ...
    new: str                   # ... and what it becomes
    tests: tuple[str, ...]     # pytest node ids that must fail on it
    worlds: tuple[int, ...] = (2,)   # the world sizes to run them at (1: no mpiexec)

    def problem(self, root: Path = ROOT) -> str | None:
        """Why this mutant cannot be applied to the tree at root (None: it can)."""
        path = root / self.file
        if not path.is_file():
            return f"{self.name}: {self.file} does not exist"
        n = path.read_text().count(self.old)
        if n != 1:
            return f"{self.name}: its text occurs {n} times in {self.file} (must be exactly once): update the mutant"
        if self.old == self.new:
            return f"{self.name}: changes nothing"
        missing = [t for t in self.tests if not (root / t.split("::")[0]).is_file()]
        return f"{self.name}: no test file {missing[0]}" if missing else None

    def apply(self, root: Path) -> None:
        """Write the break into the copy of the repository at root."""
        path = root / self.file
        path.write_text(path.read_text().replace(self.old, self.new, 1))


def all_mutants() -> list[Mutant]:
    """Every mutant of every area, in AREAS order; names must be unique."""
    out = []
    for area in AREAS:
        out += importlib.import_module(f"mutation.{area}").MUTANTS
    names = [m.name for m in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"mutant names used twice: {sorted(dup)}")
    return out
