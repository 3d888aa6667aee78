"""Pipeline throughput against the micro-batch count and the micro-batch size (Narayanan et al. 2021,
Figures 12-14, scaled down to P = 2 stages on one machine).

    mpiexec -n 2 python -m mpi4py experiments/pipeline/pipeline_throughput.py  # results/pipeline_throughput.jsonl, plot

Two sweeps on a float32 GPT (C 256, 4 heads, 4 blocks, S 128 by default):

- vs M: M = 1, 2, 4, 8, 16 micro-batches of one sequence: more work per step,
  the bubble (P - 1) / (v M) shrinks;
- vs B: micro-batch size B = 1, 2, 4, 8 at a fixed 16 sequences per step
  (M = 16 / B): bigger GEMMs and fewer messages, but a bigger bubble.

for GPipe, 1F1B and the interleaved schedule (v = 2 chunks per stage, M a
multiple of P). Each point is `mpi-tp bench --pp`'s measurement
(commands.bench.pipeline.run_pipeline_shape: the median step of --steps timed
steps after --warmup untimed ones, the bubble from each step's trace). The
whole set of points is run --rounds times; each round visits the (M, B)
configurations in the opposite order to the previous one and rotates the order
of the schedules inside a configuration, so slow drift of a shared machine falls
on every schedule alike. One JSON line per point and round (with the machine,
and the 1-minute load average at the start and end of the point, since the
machine is shared). The plot and the table show, per point, the fastest timed
step over all rounds (noise on a shared machine only slows a step down, as for
the GEMM peak of `mpi-tp bench`) and the median of the rounds' median steps;
`--replot` redraws from the raw file. Needs matplotlib (the `experiments` extra).
"""
import argparse
import json
import os
import statistics
import sys

from mpi4py import MPI

from mpi_tp.commands.bench import environment
from mpi_tp.commands.bench.pipeline import run_pipeline_shape

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
COLORS = {"gpipe": "C0", "1f1b": "C1", "interleaved": "C2"}


def points(P, Ms, bs, per_step):
    """[(M, B, sweeps)]: each (M, B) once, with the sweeps it belongs to."""
    out = {}
    for M in Ms:
        out.setdefault((M, 1), []).append("M")
    for b in bs:
        if per_step % b == 0:
            out.setdefault((per_step // b, b), []).append("b")
    return [(M, b, sweeps) for (M, b), sweeps in out.items()]


def measure(comm, args, shape):
    C, H, L, S = shape
    P, rank = comm.Get_size(), comm.Get_rank()
    configs = points(P, args.micro_batches, args.batch_sizes, args.sequences)
    env = environment(comm)
    if rank == 0:
        open(args.results, "w").close()                    # a fresh file; one line per point as it ends
    rows = []
    for rnd in range(args.rounds):
        order = configs if rnd % 2 == 0 else configs[::-1]
        for i, (M, b, sweeps) in enumerate(order):
            k = (rnd + i) % len(SCHEDULES)
            for name, V in SCHEDULES[k:] + SCHEDULES[:k]:
                if V > 1 and M % P:
                    continue
                load0 = os.getloadavg()
                r = run_pipeline_shape(comm, C=C, H=H, L=L, S=S, B=b, steps=args.steps, warmup=args.warmup,
                                       dtype="float32", tp=1, pp=P, dp=1, micro_batches=M, schedule=name,
                                       virtual=V, seed=0)
                load1 = os.getloadavg()
                step_s = r["step_ms"]["median"] / 1e3
                r.update(experiment="pipeline_throughput", round=rnd, sweeps=sweeps, micro_batch_size=b,
                         sequences_per_step=b * M, sequences_per_s_per_rank=b * M / step_s / P,
                         tokens_per_s_per_rank=b * M * S / step_s / P,
                         loadavg_start=list(load0), loadavg_end=list(load1), environment=env)
                rows.append(r)
                if rank == 0:
                    with open(args.results, "a") as f:
                        f.write(json.dumps(r) + "\n")
                    print(f"round {rnd} {name:11s} M={M:2d} B={b}: step {r['step_ms']['median']:7.1f} ms, "
                          f"{r['tokens_per_s_per_rank']:6.0f} tok/s/rank, bubble {r['bubble']['measured']:.3f} "
                          f"(formula {r['bubble']['formula']:.3f}), load {load0[0]:.2f} -> {load1[0]:.2f}",
                          flush=True)
    return rows


def summary(rows):
    """{(schedule, M, B): over the rounds, the median of the per-round median steps and the fastest step}."""
    groups = {}
    for r in rows:
        groups.setdefault((r["schedule"], r["micro_batches"], r["micro_batch_size"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        P, S, n = rs[0]["pp"], rs[0]["shape"]["block_size"], key[1] * key[2]
        ms = statistics.median(r["step_ms"]["median"] for r in rs)
        best = min(r["step_ms"]["min"] for r in rs)
        out[key] = {"ms": ms, "best_ms": best, "tok": n * S / ms * 1e3 / P, "best_tok": n * S / best * 1e3 / P,
                    "seq": n / ms * 1e3 / P, "best_seq": n / best * 1e3 / P,
                    "bubble": statistics.median(r["bubble"]["measured"] for r in rs),
                    "formula": rs[0]["bubble"]["formula"], "sweeps": rs[0]["sweeps"], "n": len(rs)}
    return out


def ordered(summ, name, sweep):
    x = 1 if sweep == "M" else 2
    return sorted((k for k, v in summ.items() if k[0] == name and sweep in v["sweeps"]), key=lambda k: k[x])


def table(summ):
    lines = [("| sweep | schedule | M | B | step ms: median / fastest | sequences/s per rank: median / fastest | "
              "tokens/s per rank: median / fastest | bubble | formula |"), "|---|---|---|---|---|---|---|---|---|"]
    for sweep in ("M", "b"):
        for name, _ in SCHEDULES:
            for k in ordered(summ, name, sweep):
                v = summ[k]
                lines.append(f"| {sweep.upper()} | {name} | {k[1]} | {k[2]} | {v['ms']:.0f} / {v['best_ms']:.0f} | "
                             f"{v['seq']:.2f} / {v['best_seq']:.2f} | {v['tok']:.0f} / {v['best_tok']:.0f} | "
                             f"{v['bubble']:.3f} | {v['formula']:.3f} |")
    return "\n".join(lines)


def plot(rows, summ, args, shape, command):
    import matplotlib
    matplotlib.use("Agg")
    # experiments/bench/scaling.py's stamp, as on the other measured figures
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))     # experiments/bench/scaling.py
    from scaling import stamp

    C, H, L, S = shape
    P = rows[0]["pp"]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4.4), dpi=110)
    for name, V in SCHEDULES:
        for ax, sweep, x in ((a0, "M", 1), (a1, "b", 2)):
            keys = ordered(summ, name, sweep)
            if not keys:
                continue
            xs = [k[x] for k in keys]
            ax.plot(xs, [summ[k]["best_tok"] for k in keys], "o-", color=COLORS[name])
            ax.plot(xs, [summ[k]["tok"] for k in keys], "s--", color=COLORS[name], alpha=0.45, ms=3, lw=1)
            if sweep == "M":                   # bubble only: the largest M's fastest step, times (1 + bubble)
                ref = keys[-1]
                full = summ[ref]["best_tok"] * (1 + summ[ref]["formula"])
                ax.plot(xs, [full / (1 + (P - 1) / (V * m)) for m in xs], ":", color=COLORS[name], lw=1.5)
            else:                              # the rate without the bubble: fastest x (1 + formula)
                ax.plot(xs, [summ[k]["best_tok"] * (1 + summ[k]["formula"]) for k in keys], "^:",
                        color=COLORS[name], lw=1.2, ms=4)
    a0.set(xlabel="micro-batches per step, M (micro-batch size 1)", ylabel="tokens/s per rank")
    a0.set_title("vs M at B = 1: the bubble (P - 1) / (v M) shrinks", fontsize=10)
    a1.set(xlabel=f"micro-batch size B (M = {args.sequences} / B micro-batches)", ylabel="tokens/s per rank")
    a1.set_title(f"vs B at {args.sequences} sequences per step: bigger B, bigger bubble", fontsize=10)
    for ax, ticks in ((a0, args.micro_batches), (a1, args.batch_sizes)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=COLORS[n], lw=2, label=n + (" (v = 2)" if v > 1 else "")) for n, v in SCHEDULES]
    styles = [Line2D([], [], color="k", marker="o", label="fastest step over all rounds"),
              Line2D([], [], color="k", marker="s", ls="--", alpha=0.45, ms=3, label="median of the rounds' medians"),
              Line2D([], [], color="k", ls=":", label=f"1 / (1 + bubble formula), scaled to the fastest at "
                                                        f"M = {args.micro_batches[-1]}")]
    a0.legend(handles=handles + styles, fontsize=6, loc="lower center", ncol=2)
    a1.legend(handles=handles + styles[:2] + [Line2D([], [], color="k", marker="^", ls=":", ms=4,
                                                     label="fastest x (1 + bubble formula): without the bubble")],
              fontsize=6, loc="lower center", ncol=2)
    fig.suptitle(f"Pipeline throughput, P = {P} stages ({P} ranks), float32 GPT C {C}, {H} heads, {L} blocks, "
                 f"S {S}; {args.rounds} rounds of {rows[0]['steps']} timed steps per point", fontsize=9)
    loads = [x for r in rows for x in (r["loadavg_start"][0], r["loadavg_end"][0])]
    env = dict(rows[0]["environment"], mpi=" ".join(rows[0]["environment"]["mpi"].replace("Version:", "").split()))
    note = (stamp(env, command) + f"; shared machine: 1-min load average during the points "
            f"{min(loads):.1f}-{max(loads):.1f}; raw: experiments/pipeline/results/{os.path.basename(args.results)}")
    fig.text(0.01, 0.005, note, fontsize=5.5, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(args.figure)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="256,4,4,128", help="C,H,L,S (default 256,4,4,128)")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="the M sweep (B = 1)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="the B sweep")
    ap.add_argument("--sequences", type=int, default=16, help="sequences per step in the b sweep (default 16)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per point (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="passes over all the points (default 5)")
    ap.add_argument("--results", default=os.path.join(HERE, "results", "pipeline_throughput.jsonl"))
    ap.add_argument("--figure", default=os.path.join(HERE, "..", "..", "docs", "figures", "pipeline_throughput.png"))
    ap.add_argument("--replot", action="store_true", help="only redraw the figure from --results")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    comm = MPI.COMM_WORLD
    argv = [a for a in sys.argv[1:] if a != "--replot"]
    command = " ".join(["python -m mpi4py experiments/pipeline/pipeline_throughput.py"] + argv)
    if args.replot:
        if comm.Get_rank() == 0:
            with open(args.results) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            command = f"mpiexec -n {rows[0]['environment']['ranks']} {command}"
            args.rounds = max(r["round"] for r in rows) + 1
            plot(rows, summary(rows), args, shape, command)
            print(table(summary(rows)))
        return
    command = f"mpiexec -n {comm.Get_size()} {command}"
    rows = measure(comm, args, shape)
    if comm.Get_rank() == 0:
        summ = summary(rows)
        print(table(summ))
        plot(rows, summ, args, shape, command)
        print(f"wrote {args.results} and {args.figure}")


if __name__ == "__main__":
    main()
