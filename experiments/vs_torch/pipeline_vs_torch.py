"""mpi_tp's pipeline, with and without receives posted ahead, against PyTorch's own pipelines on the same
shapes, run back to back.

    python experiments/vs_torch/pipeline_vs_torch.py --torch-python /tmp/torchpeer/venv/bin/python --rounds 3

P = 2 stages, one BLAS thread per rank, float32. For every round, each of the
peer's configs (a: C 256, 4 heads, 4 blocks, S 128, 8 sequences per step; c:
C 1024, 16 heads, 2 blocks, 4 sequences), schedule (1f1b, gpipe) and M (8, 4
micro-batches of 8 / M sequences; M must divide the config's batch) runs three
jobs one right after the other, their order rotated every round:

- before: `mpiexec -n 2 mpi-tp bench --pp 2` with MPI_TP_PIPE_PREPOST=0 (each
  receive posted when its action starts and waited at once: the old engine);
- after: the same with MPI_TP_PIPE_PREPOST=2 (the receives of the next two
  actions posted before each action computes: the default);
- torch: the peer's `pipe.py` (torch.distributed.pipelining, Schedule1F1B or
  ScheduleGPipe, gloo) under torchrun.

Each job times --steps steps after --warmup untimed ones and reports the median
step (the slower rank's time per step). Ours also gives the bubble, measured
from each timed step's trace as `mpi-tp bench --pp` and `mpi-tp explain --layer
pipeline` define it: (the span of the step's actions - the busiest stage's
time in its actions) / that busy time, i.e. idle over busy, next to (P - 1) / M;
and the time each stage spent blocked in receives. PyTorch's bubble is not
measured (no trace of its actions). Before every job the peer's wait_quiet.py
waits up to --quiet-timeout s for an idle machine; what it saw and the 1-minute
load average go into each line of --out (JSON lines). The table printed (and the
figure) give, per point, the median over rounds of each job's median step (the
table also the fastest round's: noise on a shared machine only slows a job
down); only ratios from the same run mean something on a shared machine. --replot redraws
from --out alone. The peer is a measuring stick, not a dependency: it needs torch
in --torch-python (`pip install torch==2.13.0`, the CPU wheel).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from compare_torch import run  # a command whose failure ends the comparison with its output

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {"a": (256, 4, 4, 128, 8), "c": (1024, 16, 2, 128, 4)}     # the peer's: C, H, L, S, sequences per step
JOBS = ("before", "after", "torch")
PREPOST = {"before": "0", "after": "2"}


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ours(job, cfg, name, M, args, env):
    C, H, L, S, batch = CONFIGS[cfg]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.jsonl")
        run([shutil.which("mpiexec"), "-n", "2", sys.executable, "-m", "mpi_tp", "bench", "--pp", "2",
             "--micro-batches", str(M), "--schedule", name, "--custom", f"{C},{H},{L},{S},{batch // M}",
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", out],
            dict(env, MPI_TP_PIPE_PREPOST=PREPOST[job]))
        r = lines(out)[-1]
    assert r["receives_posted_ahead"] == int(PREPOST[job])
    return {"step_ms": r["step_ms"]["median"], "step_ms_min": r["step_ms"]["min"], "bubble": r["bubble"]["measured"],
            "bubble_formula": r["bubble"]["formula"], "receive_wait_ms_per_stage": r["receive_wait_ms_per_stage"],
            "receives_posted_ahead": r["receives_posted_ahead"], "environment": r["environment"],
            "gemm_peak_gflops_per_rank": r["gemm_peak_gflops_per_rank"]}


def torch(cfg, name, M, args, env):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.jsonl")
        run([os.path.join(os.path.dirname(args.torch_python), "torchrun"), "--standalone", "--nproc_per_node=2",
             "pipe.py", "--config", cfg, "--schedule", name, "--microbatches", str(M), "--threads", "1",
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", out], env, cwd=args.peer)
        r = lines(out)[-1]
    return {"step_ms": r["step_ms"], "torch": r["torch"]}


def quiet(args):
    r = subprocess.run([sys.executable, os.path.join(args.peer, "wait_quiet.py"), "--max-busy", "0.15",
                        "--timeout", str(args.quiet_timeout)], capture_output=True, text=True)
    return r.stdout.strip()


def measure(args, env):
    points = [(c, n, M) for c in args.configs for n in args.schedules for M in args.micro_batches
              if CONFIGS[c][4] % M == 0]
    open(args.out, "w").close()
    rows = []
    for rnd in range(args.rounds):
        for i, (cfg, name, M) in enumerate(points):
            k = (rnd + i) % len(JOBS)
            for job in JOBS[k:] + JOBS[:k]:                  # each job first, second and third in turn
                seen = quiet(args)
                load = os.getloadavg()[0]
                r = torch(cfg, name, M, args, env) if job == "torch" else ours(job, cfg, name, M, args, env)
                r.update(round=rnd, job=job, config=cfg, schedule=name, micro_batches=M, pp=2, steps=args.steps,
                         warmup=args.warmup, quiet=seen, loadavg_1min=[load, os.getloadavg()[0]],
                         date=time.strftime("%Y-%m-%d %H:%M"))
                rows.append(r)
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
                extra = (f", bubble {r['bubble']:.3f}, waits {', '.join(f'{w:.0f}' for w in r['receive_wait_ms_per_stage'])}"
                         f" ms" if job != "torch" else "")
                print(f"round {rnd} {cfg} {name:5s} M={M} {job:6s}: {r['step_ms']:7.1f} ms{extra}; {seen}; "
                      f"load {load:.2f}", flush=True)
    return rows


def summary(rows):
    """{(config, schedule, M): {job: median over rounds of the step ms, ...}}"""
    out = {}
    for r in rows:
        out.setdefault((r["config"], r["schedule"], r["micro_batches"]), {}).setdefault(r["job"], []).append(r)
    res = {}
    for key, jobs in out.items():
        med = {j: statistics.median(r["step_ms"] for r in rs) for j, rs in jobs.items()}
        med.update({j + "_best": min(r["step_ms"] for r in rs) for j, rs in jobs.items()})   # noise only slows
        for j in ("before", "after"):
            med[j + "_bubble"] = statistics.median(r["bubble"] for r in jobs[j])
            med[j + "_wait"] = [statistics.median(r["receive_wait_ms_per_stage"][s] for r in jobs[j]) for s in (0, 1)]
        med["formula"], med["n"] = jobs["before"][0]["bubble_formula"], len(jobs["torch"])
        res[key] = med
    return res


def table(summ):
    out = ["| config | schedule | M | ours before ms | ours after ms | PyTorch ms | after / before | after / PyTorch | "
           "bubble before / after (formula) | blocked in receives, stage 0 / 1, before -> after ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for (cfg, name, M), v in sorted(summ.items(), key=lambda kv: (kv[0][0], kv[0][1], -kv[0][2])):
        ms = " | ".join(f"{v[j]:.0f} ({v[j + '_best']:.0f})" for j in JOBS)
        out.append(f"| {cfg} | {name} | {M} | {ms} | {v['after'] / v['before']:.2f} ({v['after_best'] / v['before_best']:.2f}) "
                   f"| {v['after'] / v['torch']:.2f} ({v['after_best'] / v['torch_best']:.2f}) | {v['before_bubble']:.3f} / "
                   f"{v['after_bubble']:.3f} ({v['formula']:.3f}) | {v['before_wait'][0]:.0f} / "
                   f"{v['before_wait'][1]:.0f} -> {v['after_wait'][0]:.0f} / {v['after_wait'][1]:.0f} |")
    return "\n".join(out) + "\n\nms: the median over rounds of each job's median step (in brackets: the fastest round's)"


def plot(rows, summ, figure, command, raw):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))     # experiments/bench/scaling.py
    from scaling import stamp        # the stamp of the other measured figures

    keys = sorted(summ, key=lambda k: (k[0], k[1], -k[2]))
    colors = {"before": "C7", "after": "C0", "torch": "C3"}
    labels = {"before": "mpi_tp, receive posted when its action starts", "after": "mpi_tp, receives posted "
              "2 actions ahead", "torch": "PyTorch torch.distributed.pipelining"}
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    top = max(r["step_ms"] for r in rows)
    for j, job in enumerate(JOBS):
        xs = [i + (j - 1) * 0.27 for i in range(len(keys))]
        ax.bar(xs, [summ[k][job] for k in keys], 0.25, color=colors[job], label=labels[job])
        for x, k in zip(xs, keys):          # each round's median step, as a dot
            pts = [r["step_ms"] for r in rows if (r["config"], r["schedule"], r["micro_batches"]) == k
                   and r["job"] == job]
            ax.plot([x] * len(pts), pts, "k.", ms=3)
        if job != "torch":
            for x, k in zip(xs, keys):
                ax.text(x, 0.03 * top, f"{summ[k][job + '_bubble']:.3f}", ha="center", va="bottom",
                        fontsize=6, color="white", rotation=90)      # the bubble, inside even a short bar
    ax.set_xticks(range(len(keys)), [f"config {c}\n{n}, M = {M}" for c, n, M in keys], fontsize=8)
    ax.set_ylabel("step ms (median over rounds; dots: each round)")
    ax.set_title("P = 2 stages, float32, 1 thread per rank; in mpi_tp's bars: bubble = "
                 "idle / busiest stage's busy time", fontsize=9)
    ax.set_ylim(0, 1.3 * top)                                   # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.grid(axis="y", alpha=0.3)
    env = dict(next(r for r in rows if r["job"] != "torch")["environment"])
    loads = [x for r in rows for x in r["loadavg_1min"]]
    note = (stamp(env, "\n".join(textwrap.wrap(command, 160, break_on_hyphens=False))) + f"\ntorch {next(r for r in rows if r['job'] == 'torch')['torch']}; shared machine: "
            f"1-min load average {min(loads):.1f}-{max(loads):.1f}; "
            f"raw: experiments/vs_torch/results/{os.path.basename(raw)}")
    fig.text(0.01, 0.005, note, fontsize=5.5, va="bottom")
    fig.tight_layout(rect=(0, 0.04 + 0.02 * note.count("\n"), 1, 1))
    fig.savefig(figure)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", default=os.path.join(HERE, "..", "..", "..", "shared", "peers", "torch_tp"))
    ap.add_argument("--torch-python", default="/tmp/torchpeer/venv/bin/python", help="a Python with torch")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["a", "c"])
    ap.add_argument("--schedules", nargs="+", choices=["1f1b", "gpipe"], default=["1f1b", "gpipe"])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per job (default 6, as pipe.py)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2, as pipe.py)")
    ap.add_argument("--quiet-timeout", type=float, default=30, help="longest wait for an idle machine (s)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "pipeline_vs_torch.jsonl"))
    ap.add_argument("--figure", default=os.path.join(HERE, "..", "..", "docs", "figures", "pipeline_vs_torch.png"))
    ap.add_argument("--replot", action="store_true", help="only redraw the figure and the table from --out")
    args = ap.parse_args()
    command = " ".join(["python experiments/vs_torch/pipeline_vs_torch.py"]
                       + [a for a in sys.argv[1:] if a != "--replot"])
    if args.replot:
        rows = lines(args.out)
    else:
        for need in (os.path.join(args.peer, "pipe.py"), args.torch_python):
            if not os.path.exists(need):
                sys.exit(f"missing {need}: see --help (the peer is shared/peers/torch_tp, torch in --torch-python)")
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        rows = measure(args, env)
    summ = summary(rows)
    print(table(summ))
    plot(rows, summ, args.figure, command, args.out)
    print(f"raw: {os.path.relpath(args.out)}; figure: {os.path.relpath(args.figure)}; "
          f"medians over {max(r['round'] for r in rows) + 1} rounds")


if __name__ == "__main__":
    main()
