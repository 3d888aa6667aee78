"""Step time and wire bytes before and after issue 19's mechanisms, in one run, through `mpi-tp train`.

    python experiments/comm/fidelity_before_after.py --before b6f68d4 --rounds 3
    python experiments/comm/fidelity_before_after.py --replot experiments/comm/results/fidelity_before_after.jsonl

The commit `--before` is unpacked into a temporary folder (git archive) and run from there with
PYTHONPATH; the working tree is "after". Each round runs every layout with one version, then the
other (alternating which goes first), 2 ranks, shape a of `mpi-tp bench` (C 256, H 4, L 4, S 128,
global batch 8), float32, one BLAS thread per rank, no dropout:

    tp        --tp 2
    tp+sp     --tp 2 --sequence-parallel
    dp+zero1  --dp 2 --zero 1 --batch-size 4
    pp2       --pp 2 --micro-batches 4 --batch-size 2

Step time: the median of the logged steps after the first two (metrics.jsonl's step_s), then the
median over rounds. Wire bytes per step: the run's counters (run.json's communication) divided by
the steps (one evaluation batch of forward passes is included in both versions alike).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHAPE = ["--n-embd", "256", "--n-head", "4", "--n-layer", "4", "--block-size", "128", "--dropout", "0",
         "--log-every", "1", "--eval-every", "100000", "--eval-batches", "1", "--sample-len", "0", "--warmup", "2"]
LAYOUTS = {"tp": ["--tp", "2", "--batch-size", "8"],
           "tp+sp": ["--tp", "2", "--sequence-parallel", "--batch-size", "8"],
           "dp+zero1": ["--dp", "2", "--zero", "1", "--batch-size", "4"],
           "pp2": ["--pp", "2", "--micro-batches", "4", "--batch-size", "2"]}


def unpack(rev: str) -> str:
    where = tempfile.mkdtemp(prefix="mpi_tp_before_")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    return where


def imports_from(code: str) -> None:
    """Stop unless `python -m mpi_tp`, run as run() runs it, imports the package from `code`."""
    env = dict(os.environ, PYTHONPATH=code)
    where = subprocess.run([sys.executable, "-c", "import mpi_tp; print(mpi_tp.__file__)"], env=env, cwd=code,
                           capture_output=True, text=True).stdout.strip()
    if not where.startswith(os.path.realpath(code)):
        raise SystemExit(f"python imports mpi_tp from {where}, not from {code}")


def run(code: str, layout: str, steps: int) -> dict:
    out = tempfile.mkdtemp(prefix="mpi_tp_fidelity_")
    env = dict(os.environ, PYTHONPATH=code, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi_tp", "train", *SHAPE, *LAYOUTS[layout],
           "--steps", str(steps), "--out", out]
    # cwd = the code itself: `python -m` puts the working folder first on sys.path, before PYTHONPATH
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=code)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps_s = [json.loads(line)["step_s"] for line in f if '"step_s"' in line]
    with open(os.path.join(out, "run.json")) as f:
        counters = json.load(f)["communication"]
    counters = counters.get("train_steps", counters)     # by phase since issue 38: the steps' alone
    shutil.rmtree(out, ignore_errors=True)
    wire = {}
    for key, v in counters.items():
        group = key.split("/")[0]
        wire[group] = wire.get(group, 0) + v["wire_bytes"] / steps
    return {"step_ms": 1e3 * statistics.median(steps_s[2:]), "wire_bytes_per_step": wire,
            "counters": {k: {"calls": v["calls"] / steps, "wire_bytes": v["wire_bytes"] / steps}
                         for k, v in counters.items()}}


def table(rows) -> str:
    lines = ["| layout | step ms before | after | after / before | wire MB per step before | after |",
             "|---|---|---|---|---|---|"]
    for layout in LAYOUTS:
        mine = [r for r in rows if r["layout"] == layout]
        med = {v: statistics.median(r["step_ms"] for r in mine if r["version"] == v) for v in ("before", "after")}
        wire = {v: next(r["wire_bytes_per_step"] for r in mine if r["version"] == v) for v in ("before", "after")}
        text = {v: ", ".join(f"{g} {b / 1e6:.2f}" for g, b in sorted(wire[v].items())) for v in wire}
        lines.append(f"| {layout} | {med['before']:.0f} | {med['after']:.0f} | {med['after'] / med['before']:.2f} | "
                     f"{text['before']} | {text['after']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="b6f68d4", help="the commit to compare with (default: before issue 19)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "fidelity_before_after.jsonl"))
    ap.add_argument("--replot", metavar="JSONL", help="print the table from earlier raw data")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            print(table([json.loads(line) for line in f][1:]))
        return
    before = unpack(args.before)
    for code in (before, ROOT):
        imports_from(code)
    rows = []
    try:
        for k in range(args.rounds):
            for layout in LAYOUTS:
                order = ("before", "after") if k % 2 == 0 else ("after", "before")
                for version in order:
                    r = run(before if version == "before" else ROOT, layout, args.steps)
                    rows.append({"round": k, "layout": layout, "version": version, "load": os.getloadavg()[0], **r})
                    print(f"round {k} {layout} {version}: {r['step_ms']:.0f} ms, load {rows[-1]['load']:.1f}",
                          flush=True)
    finally:
        shutil.rmtree(before, ignore_errors=True)
    head = {"before": args.before, "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
            "machine": subprocess.run([sys.executable, "-c", "from mpi_tp.core.runtime import machine_text; "
                                       "print(machine_text())"], capture_output=True, text=True).stdout.strip()}
    with open(args.out, "w") as f:
        for r in [head] + rows:
            f.write(json.dumps(r) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
