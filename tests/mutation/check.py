"""The mutation check: break each mechanism on purpose, one line at a time, and see the tests catch it.

    python tests/mutation/check.py                    every mutant (a few minutes on 2 cores)
    python tests/mutation/check.py --only regions/    the mutants whose names start so
    python tests/mutation/check.py --list             the mutants, what each breaks, its tests

Each mutant (tests/mutation/<area>.py) is written into a fresh copy of the repository's mpi_tp/ and
tests/ (the tree here is never touched), and its tests run there at their world sizes, as tests/run.sh
runs them (1 rank without mpiexec; N under `mpiexec -n N python -m mpi4py -m pytest -m mpi`), stopping
at the first failure. A mutant is caught when a test fails; it survives when every test passes.
First the same tests run on an unmutated copy: a test that fails there would catch every mutant, so
the check stops and says so. A run that neither passes nor fails (a hang past --timeout, a crash
before any test ran, no test selected) is reported as such, never as a catch.

Exit status 0 when every mutant is caught, 1 when one survived or could not be judged, 2 when the
check itself cannot run (a stale mutant, a failing baseline). Run it before a change to a mechanism
lands, and add a mutant with every new mechanism (README.md, "The mutation check").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # tests/, for `mutation.*`
from mutation.mutant import ROOT, Mutant, all_mutants

COPIED = ("mpi_tp", "tests", "docs", "experiments", "setup.cfg", "pyproject.toml", "README.md")
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "*.egg-info")


def copy_tree(dest: Path) -> Path:
    """The parts of the repository a test may read, copied to dest."""
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=JUNK)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest


def pytest_command(world: int, tests: list[str], python: str, mpiexec: str) -> list[str]:
    args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "--color=no", "-rfE", "--with-mpi", *tests]
    if world == 1:
        return [python, *args]
    return [mpiexec, "-n", str(world), python, "-m", "mpi4py", *args, "-m", "mpi"]


def run_tests(root: Path, world: int, tests: list[str], opts) -> dict:
    """Run tests at one world size in the copy at root: {"outcome": passed|failed|timeout|error, ...}."""
    env = dict(os.environ, PYTHONPATH=str(root), MPI_TP_EXPECT_WORLD=str(world), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(pytest_command(world, tests, opts.python, opts.mpiexec), cwd=root, env=env,
                           capture_output=True, text=True, timeout=opts.timeout, errors="replace", check=False)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "seconds": time.perf_counter() - t0, "world": world, "failed": []}
    out = p.stdout + p.stderr
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.MULTILINE)))
    # pytest: 0 all passed, 1 tests failed; anything else (interrupted, internal error, usage, no tests)
    # is not a verdict on the mechanism
    outcome = {0: "passed", 1: "failed"}.get(p.returncode, "error")
    if outcome == "failed" and not failed:
        outcome = "error"
    return {"outcome": outcome, "seconds": time.perf_counter() - t0, "world": world, "failed": failed,
            "tail": "" if outcome in ("passed", "failed") else out[-2000:]}


def judge(mutant: Mutant, opts) -> dict:
    """Apply mutant to a fresh copy and run its tests world by world until one fails."""
    with tempfile.TemporaryDirectory(prefix="mpi_tp_mutant_") as tmp:
        root = copy_tree(Path(tmp))
        mutant.apply(root)
        runs = []
        for world in mutant.worlds:
            runs.append(run_tests(root, world, list(mutant.tests), opts))
            if runs[-1]["outcome"] != "passed":
                break
    last = runs[-1]
    verdict = {"passed": "SURVIVED", "failed": "caught"}.get(last["outcome"], last["outcome"])
    return {"name": mutant.name, "verdict": verdict, "runs": runs,
            "seconds": sum(r["seconds"] for r in runs)}


def baseline(mutants: list[Mutant], opts) -> list[str]:
    """Every mutant's tests on an unmutated copy, one run per world size: the problems found."""
    by_world: dict[int, set[str]] = {}
    for m in mutants:
        for w in m.worlds:
            by_world.setdefault(w, set()).update(m.tests)
    problems = []
    with tempfile.TemporaryDirectory(prefix="mpi_tp_baseline_") as tmp:
        root = copy_tree(Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(root))
        where = subprocess.run([opts.python, "-c", "import mpi_tp; print(mpi_tp.__file__)"], cwd=root, env=env,
                               capture_output=True, text=True, check=False).stdout.strip()
        if not where.startswith(str(root)):
            return [(f"the copy's mpi_tp is not the one imported ({where or 'import failed'}): an installed "
                     "mpi_tp shadows PYTHONPATH; install with `pip install -e .`")]
        for world, tests in sorted(by_world.items()):
            r = run_tests(root, world, sorted(tests), opts)
            if r["outcome"] != "passed":
                problems.append(f"unmutated, at {world} rank(s): {r['outcome']} {' '.join(r['failed'])}"
                                f"{r.get('tail', '')[-600:]}")
    return problems


def describe(result: dict) -> str:
    last = result["runs"][-1]
    worlds = "/".join(str(r["world"]) for r in result["runs"])
    if result["verdict"] == "caught":
        how = f"by {last['failed'][0]} at {last['world']} rank(s)"
    elif result["verdict"] == "SURVIVED":
        how = f"every test passed at {worlds} rank(s)"
    else:
        how = f"at {last['world']} rank(s): {last.get('tail', '').strip().splitlines()[-1:] or ['no output']}"
    return f"{result['verdict']:9} {result['name']:46} {how} ({result['seconds']:.0f} s)"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=[], metavar="PREFIX", help="mutants whose names start so")
    ap.add_argument("--list", action="store_true", help="list the mutants and stop")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="mutants judged at once (default: half the cores)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for one test run (default 300)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run (faster; trust it)")
    ap.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    ap.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    ap.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec", help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    opts = parser().parse_args(argv)

    mutants = [m for m in all_mutants() if not opts.only or m.name.startswith(tuple(opts.only))]
    if not mutants:
        print(f"no mutant's name starts with {' or '.join(opts.only)} (--list shows them)")
        return 2
    if opts.list:
        for m in mutants:
            print(f"{m.name:46} {m.breaks}\n{'':46} {m.file}; caught by {', '.join(m.tests)} at {m.worlds}")
        return 0
    stale = [p for p in (m.problem() for m in mutants) if p]
    if stale:
        print("\n".join(stale))
        return 2
    t0 = time.perf_counter()
    if not opts.no_baseline:
        problems = baseline(mutants, opts)
        if problems:
            print("the tests fail without a mutant, so no catch would mean anything:\n" + "\n".join(problems))
            return 2
        print(f"baseline: the tests pass unmutated ({time.perf_counter() - t0:.0f} s)")
    print(f"{len(mutants)} mutants, {opts.jobs} at a time", flush=True)
    results = []
    with ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        for result in pool.map(lambda m: judge(m, opts), mutants):
            results.append(result)
            print(describe(result), flush=True)
    caught = sum(r["verdict"] == "caught" for r in results)
    survived = [r["name"] for r in results if r["verdict"] == "SURVIVED"]
    unjudged = [r["name"] for r in results if r["verdict"] not in ("caught", "SURVIVED")]
    def named(names):
        return f" ({', '.join(names)})" if names else ""
    print(f"{caught} of {len(results)} mutants caught, {len(survived)} survived{named(survived)}, "
          f"{len(unjudged)} not judged{named(unjudged)} in {time.perf_counter() - t0:.0f} s")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
