"""Per-token latency against context length, with the KV cache and without, at T = 1 and T = 2.

    mpiexec -n 1 python -m mpi4py experiments/inference/inference_latency.py      # T = 1: its lines, then the plots
    mpiexec -n 2 python -m mpi4py experiments/inference/inference_latency.py      # T = 2
    python experiments/inference/inference_latency.py --plot                      # only redraw, from the raw files

At shape c of `mpi-tp bench` (float32, C 1024, 16 heads, 2 blocks, S 128),
batch 1, one new byte at context n (the n-th position, n = 8 .. 128):

- cached: Decoder.prefill of n - 1 bytes (not timed), then one Decoder.step:
  the new position's q/k/v, attention over the n cached columns, the logits;
- full: GPT.last_logits of the n bytes, the forward pass over the whole context
  that mpi_tp.inference.sampling.sample runs for every new byte.

Both end with the same gather of the last position's V logits. A point's time
is the slowest rank's; the points are visited --rounds times, in the opposite
order each round, so that slow drift of a shared machine falls on all of them
alike; the plot shows the median over rounds and the min-max range. A run
replaces the lines of its own T in experiments/inference/results/inference_latency.jsonl
(one per point and round, with the machine and the 1-minute load average).
Generating up to n bytes one at a time costs the sum of these per-token
times: linear in n with the cache, quadratic without (the right panel sums the
measured curves, interpolated).

--plot also draws docs/figures/inference_batching.png from the JSON lines of
`mpi-tp bench --inference` (experiments/inference/results/inference_bench.jsonl: tokens/s
and the share of decode time in collectives against the batch). Needs
matplotlib (the `experiments` extra).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "inference_latency.jsonl")
BENCH = os.path.join(HERE, "results", "inference_bench.jsonl")
FIGURES = os.path.join(HERE, "..", "..", "docs", "figures")
SHAPE_C = dict(n_embd=1024, n_head=16, n_layer=2, block_size=128)


def measure(comm, contexts, rounds):
    from mpi_tp.commands.bench import environment
    from mpi_tp.inference.decode import Decoder
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.model.gpt import GPT
    from mpi_tp.parallel.topology import Topology

    topo = Topology.create(comm, tp=comm.Get_size())
    model = GPT(GPTConfig(**SHAPE_C), topo, dtype="float32").eval()
    dec = Decoder(model, 1)
    text = numpy.random.default_rng(0).integers(0, 256, SHAPE_C["block_size"])
    env = environment(comm)
    runs = {"cached": lambda n: dec.step([text[n - 1]]),
            "full": lambda n: model.last_logits(text[None, :n])}
    for n in contexts[:2]:                                         # warm-up, not recorded
        dec.prefill([text[:n - 1].tolist()])
        runs["cached"](n), runs["full"](n)
    rows = []
    for r in range(rounds):
        load0 = os.getloadavg()
        for n in contexts if r % 2 == 0 else contexts[::-1]:
            for mode in ("cached", "full") if r % 2 == 0 else ("full", "cached"):
                if mode == "cached":
                    dec.prefill([text[:n - 1].tolist()])
                comm.Barrier()
                t = time.perf_counter()
                runs[mode](n)
                t = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
                rows.append({"tp": topo.tp.size, "mode": mode, "context": n, "batch": 1, "round": r,
                             "ms": 1e3 * t, "shape": SHAPE_C, "dtype": "float32"})
        load1 = os.getloadavg()
        for row in rows:
            if row["round"] == r:
                row.update(loadavg_start=list(load0), loadavg_end=list(load1), environment=env)
    topo.free()
    return rows


def summary(rows):
    """{(tp, mode): [(context, median, min, max)]} over rounds."""
    out = {}
    for key in sorted({(r["tp"], r["mode"]) for r in rows}):
        pts = []
        for n in sorted({r["context"] for r in rows if (r["tp"], r["mode"]) == key}):
            ms = [r["ms"] for r in rows if (r["tp"], r["mode"], r["context"]) == (*key, n)]
            pts.append((n, statistics.median(ms), min(ms), max(ms)))
        out[key] = pts
    return out


def read_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def note(rows, command, raw):
    """The stamp of experiments/bench/scaling.py (machine, MPI, BLAS, date, command), the load, the raw file."""
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))     # experiments/bench/scaling.py
    from scaling import stamp
    env = dict(rows[0]["environment"], mpi=" ".join(rows[0]["environment"]["mpi"].replace("Version:", "").split()))
    loads = [x for r in rows for x in ((r["loadavg_start"][0], r["loadavg_end"][0]) if "loadavg_start" in r
                                       else r.get("loadavg_1min", ()))]
    load = f"; 1-min load average {min(loads):.2f}-{max(loads):.2f}" if loads else ""
    return stamp(env, command) + f"{load}; shared machine; raw: experiments/inference/results/{os.path.basename(raw)}"


def plot_latency(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = summary(rows)
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=110)
    style = {"full": "s--", "cached": "o-"}
    color = {1: "C0", 2: "C1"}
    for (tp, mode), pts in summ.items():
        n, med, lo, hi = (numpy.array(v) for v in zip(*pts))
        label = f"T={tp}, {'no cache (full forward)' if mode == 'full' else 'KV cache (Decoder.step)'}"
        a0.errorbar(n, med, yerr=[med - lo, hi - med], fmt=style[mode], color=color.get(tp), capsize=2,
                    label=label, ms=4)
        k = numpy.arange(n[0], n[-1] + 1)
        a1.plot(k, numpy.cumsum(numpy.interp(k, n, med)) / 1e3, style[mode][1:], color=color.get(tp), label=label)
    a0.set(xlabel="context length (tokens: bytes)", ylabel="ms per new byte (batch 1)",
           title="per-token latency: linear in n without a cache")
    a1.set(xlabel="context length (tokens: bytes)", ylabel="seconds",
           title=f"generating bytes {summ[next(iter(summ))][0][0]}..n one at a time (sum of the left)")
    for ax in (a0, a1):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rounds = len({r["round"] for r in rows})
    fig.suptitle(f"Cached vs uncached decoding, float32 GPT C 1024, 16 heads, 2 blocks, S 128; median of {rounds} "
                 "rounds (bars: min-max)", fontsize=9)
    command = ("mpiexec -n T python -m mpi4py experiments/inference/inference_latency.py (T = 1, 2), then "
               "python experiments/inference/inference_latency.py --plot")
    fig.text(0.01, 0.005, note(rows, command, RESULTS), fontsize=5.5, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def plot_batching(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4.0), dpi=110)
    for tp in sorted({r["tp"] for r in rows}):
        sel = [r for r in rows if r["tp"] == tp]
        batches = sorted({r["batch"] for r in sel})
        tok = [[r["tokens_per_s"] for r in sel if r["batch"] == b] for b in batches]
        med = numpy.array([statistics.median(t) for t in tok])
        a0.errorbar(batches, med, yerr=[med - [min(t) for t in tok], [max(t) for t in tok] - med], fmt="o-",
                    capsize=3, label=f"T={tp}", color=f"C{tp - 1}")
        ceiling = [statistics.median(1e3 * b / r["limit_ms"] for r in sel if r["batch"] == b) for b in batches]
        a0.plot(batches, ceiling, ":", color=f"C{tp - 1}", label=f"T={tp}: memory limit, B / limit_ms")
        if tp > 1:
            share = [statistics.median(100 * r["comm_share"] for r in sel if r["batch"] == b) for b in batches]
            floor = [statistics.median(100 * r["comm_floor_ms_per_step"] / r["decode_ms_per_step"]["median"]
                                       for r in sel if r["batch"] == b) for b in batches]
            a1.plot(batches, share, "o-", color=f"C{tp - 1}", label=f"T={tp}: time in collectives (waiting included)")
            a1.plot(batches, floor, "s--", color=f"C{tp - 1}", label=f"T={tp}: the same collectives back to back")
    a0.set(xlabel="batch B (rows decoded together)", ylabel="tokens/s (B x steps / decode time)",
           title="decode throughput against the batch", yscale="log")
    a1.set(xlabel="batch B", ylabel="% of decode time", title="collectives per decode step")
    for ax in (a0, a1):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    a1.set_ylim(bottom=0)
    runs = max(sum(1 for r in rows if (r["tp"], r["batch"]) == (tp, batches[0])) for tp in (1, 2))
    c = rows[0]["shape"]
    fig.suptitle(f"mpi-tp bench --inference, float32 GPT C {c['n_embd']}, {c['n_head']} heads, {c['n_layer']} blocks, "
                 f"S {c['block_size']}, prompt {rows[0]['prompt_len']} bytes, {rows[0]['new_tokens']} "
                 f"steps; median of {runs} runs (bars: min-max)", fontsize=9)
    command = ("mpiexec -n T python -m mpi4py -m mpi_tp bench --inference --json "
               "experiments/inference/results/inference_bench.jsonl, T = 1 and 2 alternating")
    fig.text(0.01, 0.005, note(rows, command, BENCH), fontsize=5.5, va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def bench_table(rows) -> str:
    """The bench runs as a Markdown table: per T and B the median over runs (min-max), and T = 2 against T = 1."""
    med = {}
    lines = [("| T | B | runs | TTFT ms | decode ms/step (min-max) | p90 | tokens/s | collectives % (floor) | "
              "limit ms | x limit | T=2 / T=1 |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for tp in sorted({r["tp"] for r in rows}):
        for b in sorted({r["batch"] for r in rows}):
            sel = [r for r in rows if (r["tp"], r["batch"]) == (tp, b)]
            if not sel:
                continue
            step = [r["decode_ms_per_step"]["median"] for r in sel]
            med[tp, b] = statistics.median(step)
            m = {k: statistics.median(f(r) for r in sel) for k, f in (
                ("ttft", lambda r: r["ttft_ms"]["median"]), ("p90", lambda r: r["decode_ms_per_step"]["p90"]),
                ("tok", lambda r: r["tokens_per_s"]), ("comm", lambda r: 100 * r["comm_share"]),
                ("floor", lambda r: 100 * r["comm_floor_ms_per_step"] / r["decode_ms_per_step"]["median"]),
                ("limit", lambda r: r["limit_ms"]), ("ratio", lambda r: r["limit_ratio"]))}
            vs = f"{med[tp, b] / med[1, b]:.2f}" if tp > 1 and (1, b) in med else ""
            lines.append(f"| {tp} | {b} | {len(sel)} | {m['ttft']:.0f} | {med[tp, b]:.2f} ({min(step):.2f}-"
                         f"{max(step):.2f}) | {m['p90']:.2f} | {m['tok']:.0f} | {m['comm']:.1f} ({m['floor']:.1f}) | "
                         f"{m['limit']:.2f} | {m['ratio']:.2f} | {vs} |")
    return "\n".join(lines)


def plot_all():
    rows = read_lines(RESULTS)
    if rows:
        plot_latency(rows, os.path.join(FIGURES, "inference_latency.png"))
        for (tp, mode), pts in summary(rows).items():
            print(f"T={tp} {mode:6s} " + "  ".join(f"n={n}: {med:.1f}" for n, med, _, _ in pts) + "  (ms, median)")
    bench = [r for r in read_lines(BENCH) if r.get("mode") == "inference"]
    if bench:
        plot_batching(bench, os.path.join(FIGURES, "inference_batching.png"))
        print(bench_table(bench))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8, 16, 32, 48, 64, 96, 128])
    ap.add_argument("--rounds", type=int, default=7, help="passes over all the points (default 7)")
    ap.add_argument("--plot", action="store_true", help="only redraw the figures from the raw files")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if not args.plot:
        if max(args.contexts) > SHAPE_C["block_size"] or min(args.contexts) < 2:
            ap.error(f"contexts must lie in 2 .. {SHAPE_C['block_size']}")
        rows = measure(comm, args.contexts, args.rounds)
        if comm.Get_rank() == 0:
            kept = [r for r in read_lines(RESULTS) if r["tp"] != comm.Get_size()]
            with open(RESULTS, "w") as f:
                for r in kept + rows:
                    f.write(json.dumps(r) + "\n")
    if comm.Get_rank() == 0:
        plot_all()


if __name__ == "__main__":
    main()
