"""The runner of experiments/gpu/gpu_check.py: each check's jobs logged, timed and bounded, a row per check,
and the report (report.md, report.json).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY, MPIEXEC = os.environ.get("PYTHON", sys.executable), os.environ.get("MPIEXEC", "mpiexec")


class Check:
    """Runs the commands of the checks, each logged, timed and bounded; collects the report's rows."""

    def __init__(self, out: Path, standin: bool, budget_s: float):
        self.out, self.standin, self.rows = out, standin, []
        self.deadline = time.monotonic() + budget_s
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def env(self, aware: str | None = "0", **extra):
        """The jobs' environment: MPI_TP_CUDA_AWARE=aware (None: MPI's own answer), the stand-in if asked."""
        env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
        for name in ("MPI_TP_CUPY_STANDIN", "MPI_TP_CUDA_AWARE"):
            env.pop(name, None)
        if aware is not None:
            env["MPI_TP_CUDA_AWARE"] = aware
        if self.standin:
            env["MPI_TP_CUPY_STANDIN"] = "1"
        return env

    def run(self, log: str, n: int, args: list[str], env: dict, timeout=240) -> tuple[int, str]:
        """Run `mpi-tp ARGS` (`python ARGS` when args[0] is -m or -c) on n ranks; (exit status, output)."""
        py = [PY, "-m", "mpi4py"] + (args if args[0] in ("-m", "-c") else ["-m", "mpi_tp"] + args)
        cmd = [MPIEXEC, "-n", str(n)] + py
        with open(self.out / "logs" / f"{log}.log", "a") as f:
            f.write(f"$ MPI_TP_CUDA_AWARE={env.get('MPI_TP_CUDA_AWARE', '')} {' '.join(cmd)}\n")
            f.flush()
            try:
                p = subprocess.run(cmd, check=False, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, timeout=timeout, start_new_session=True)
                rc, text = p.returncode, p.stdout
            except subprocess.TimeoutExpired as e:
                rc, text = 124, (e.stdout or b"").decode(errors="replace") + f"\n(killed after {timeout} s)"
            f.write(text + f"\n(exit {rc})\n")
        return rc, text

    def row(self, name: str, fn, *args) -> None:
        """Run one check (fn returns what it compared, or raises AssertionError saying what failed)."""
        if time.monotonic() > self.deadline:
            result, detail, seconds = "NOT RUN", "out of time (--budget)", 0.0
        else:
            t = time.perf_counter()
            try:
                result, detail = "ok", fn(name, self, *args)
            except Exception as e:  # noqa: BLE001 (a check's failure is a row of the report, not the end of the run)
                what = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                result, detail = "FAILED", (what if isinstance(e, AssertionError) else f"{type(e).__name__}: {what}")[:300]
            seconds = time.perf_counter() - t
        self.rows.append({"check": name, "result": result, "seconds": round(seconds, 1), "detail": detail})
        print(f"{result:>8}  {name:<40} {seconds:6.1f} s  {detail}", flush=True)

    def na(self, name: str, why: str) -> None:
        self.rows.append({"check": name, "result": "n/a", "seconds": 0.0, "detail": why})
        print(f"{'n/a':>8}  {name:<40} {0:6.1f} s  {why}", flush=True)


def must(rc: int, text: str, what: str) -> None:
    """Assert exit status 0, else say what failed with the output's last line that is not MPI's abort notice."""
    said = [line for line in text.strip().splitlines() if line.strip() and not line.startswith(("Abort(", "("))]
    assert rc == 0, f"{what}: exit {rc}: {said[-1] if said else ''}"


def write_report(out: Path, info: dict, rows: list, args) -> None:
    (out / "report.json").write_text(json.dumps({"machine": info, "checks": rows, "argv": sys.argv}, indent=1))
    lines = [f"# GPU check, {time.strftime('%Y-%m-%d %H:%M %Z')}", "",
             f"`{' '.join(['python', 'experiments/gpu/gpu_check.py'] + sys.argv[1:])}`"
             + (" (on the CuPy stand-in, no GPU)" if args.standin else ""), ""]
    lines += [f"- {k}: {v}" for k, v in info.items()] + ["", "| check | result | s | what was compared |",
                                                         "|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['result']} | {r['seconds']} | {r['detail']} |".replace("\n", " ") for r in rows]
    (out / "report.md").write_text("\n".join(lines) + "\n")
