"""Load test of `mpi-tp serve`: streamed completions from 1 to 64 concurrent clients, loopback only.

    python experiments/serving/serve_load.py                  # full, then the hostile mix (serve_hostile.py): ~3 min
    python experiments/serving/serve_load.py --clients 1 4 --no-hostile --out /tmp/l.jsonl --figure /tmp/l.png  # quick
    python experiments/serving/serve_load.py --replot         # the table and docs/figures/serve_load.png from the JSONL

Without --checkpoint a small model is trained first (4 blocks, C 128, 40 steps, ~15 s). Each mode
runs its own 2-rank server (`--max-batch 16`): `--batching static` and `continuous` where `serve
--help` lists --batching, else the current server, "static (current)". At N clients each sends
streamed completions one after another (temperature 1, seed = request index, max_tokens from 8..96
drawn with a fixed seed, the same for every mode) until --requests (max(8, 2N)) were sent or
--level-seconds passed; the modes take turns level by level in ABBA order (drift falls on both).
Per request: time to first token (send -> first text event), per-token latency ((last text event -
first) / (tokens - 1)); per mode and level: completion tokens (usage) / wall time, p50 / p99, errors
by status, RSS (both ranks' VmRSS; /metrics' process_resident_memory_bytes where served). One JSON
line per mode, level and round (machine, command, time). Servers always end: SIGUSR1
(serve_harness.Server.stop), SIGKILL after 30 s.
"""
import argparse
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

import numpy
from serve_harness import (
    REQUEST_TIMEOUT,
    ROOT,
    TRAIN,
    Server,
    metrics,
    serve_options,
    stamp,
    stream_one,
    train,
)

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "serve_load.jsonl")
FIGURE = os.path.join(ROOT, "docs", "figures", "serve_load.png")
PROMPTS = ["The ", "Once upon a time", "In the beginning ", "It was ", "MPI ", "Tensor parallel "]


def request_body(i, max_tokens):
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens[i], "temperature": 1.0, "seed": i,
            "stream": True}


def run_level(server, clients, n_requests, max_tokens, seconds):
    """N client threads, each sending its next request when the last one ended; stops after n_requests or seconds."""
    results, counter, lock = [None] * n_requests, itertools.count(), threading.Lock()
    t0 = time.perf_counter()
    ends = [t0]

    def client():
        while time.perf_counter() - t0 < seconds:
            with lock:
                i = next(counter)
            if i >= n_requests:
                return
            results[i] = stream_one(server, request_body(i, max_tokens))
            ends.append(time.perf_counter())
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, seconds + 2 * REQUEST_TIMEOUT - (time.perf_counter() - t0)))
    wall = max(ends) - t0
    sent = [r for r in results if r is not None]
    ok = [r for r in sent if r["status"] == 200]

    def pct(key, q):
        v = [r[key] for r in ok if r[key] is not None]
        return round(float(numpy.percentile(v, q)), 2) if v else None
    tokens = sum(r["tokens"] for r in ok)
    return {"clients": clients, "requests": n_requests, "sent": len(sent), "ok": len(ok),
            "errors": dict(Counter(str(r["status"]) for r in sent if r["status"] != 200)),
            "retry_after": sorted({r["retry_after"] for r in sent if r.get("retry_after")}),
            "unfinished_clients": sum(t.is_alive() for t in threads), "wall_s": round(wall, 3),
            "tokens": tokens, "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
            **{f"{k}_p{q}_ms": pct(f"{k}_ms", q) for k in ("ttft", "tpot") for q in (50, 99)}}


def table(rows):
    head = (f"{'mode':<18} {'N':>3} {'ok':>7} {'errors':<14} {'tok/s':>7} {'TTFT p50':>9} {'p99':>8} "
            f"{'tok p50':>8} {'p99':>7} {'RSS MiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = [f"{r[k]:.1f}" if r[k] is not None else "-" for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                                                   "tpot_p99_ms")]
        errors = ",".join(f"{k}x{v}" for k, v in r["errors"].items()) or "-"
        lines.append(f"{r['label']:<18} {r['clients']:>3} {r['ok']:>3}/{r['requests']:<3} {errors:<14} "
                     f"{r['tokens_per_s'] or 0:>7.1f} {ms[0]:>9} {ms[1]:>8} {ms[2]:>8} {ms[3]:>7} "
                     f"{r['rss_end']['rss_mib'] or 0:>8.1f}")
    return "\n".join(lines) + "\n(times in ms; tok: per-token latency after the first; RSS: both ranks, at the end)"


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.4))
    for label in dict.fromkeys(r["label"] for r in rows):
        by = defaultdict(list)
        for r in rows:
            if r["label"] == label:
                by[r["clients"]].append(r)
        n = sorted(by)
        median = {k: [numpy.median([r[k] if r[k] is not None else numpy.nan for r in by[c]]) for c in n]
                  for k in ("tokens_per_s", "ttft_p99_ms", "ttft_p50_ms")}
        line, = a.plot(n, median["tokens_per_s"], "o-", label=label)
        b.plot(n, numpy.array(median["ttft_p99_ms"]) / 1e3, "o-", color=line.get_color(), label=f"{label}: p99")
        b.plot(n, numpy.array(median["ttft_p50_ms"]) / 1e3, ":", color=line.get_color(), label=f"{label}: p50")
    levels = sorted({r["clients"] for r in rows})
    for ax, title, unit in ((a, "throughput", "completion tokens / s (all clients)"),
                            (b, "time to first token", "seconds")):
        ax.set_xscale("log")
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set(xlabel="concurrent streaming clients", ylabel=unit, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.set_ylim(bottom=0)
    b.set_yscale("log")
    s, rounds = rows[0], max(r["round"] for r in rows) + 1
    fig.suptitle(f"mpi-tp serve, tp=2, --max-batch {s['max_batch']}: max_tokens 8..96, temperature 1"
                 + (f" (median of {rounds} rounds)" if rounds > 1 else ""), fontsize=10)
    load = [x for r in rows for x in r["loadavg"]]
    fig.text(0.01, 0.01, f"{s['machine']}; {s['time'][:10]}; mpi_tp {s['commit']}; shared machine, 1-min load "
             f"{min(load):.1f}-{max(load):.1f}\n{s['command']}",
             fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a saved model (default: train a small one into a temporary folder)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64], help="levels (default 1 4 16 64)")
    ap.add_argument("--requests", type=int, help="requests per level (default max(8, 2 N))")
    ap.add_argument("--level-seconds", type=float, default=120, help="no new request after this (default 120)")
    ap.add_argument("--rounds", type=int, default=1, help="every level this many times (default 1)")
    ap.add_argument("--modes", nargs="+", help="default: static continuous (current, where no --batching)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-queue", type=int, help="passed to serve (default: not passed)")
    ap.add_argument("--out", default=RESULTS, help=f"JSON lines (default {os.path.relpath(RESULTS, ROOT)})")
    ap.add_argument("--figure", default=FIGURE, help=f"default {os.path.relpath(FIGURE, ROOT)}")
    ap.add_argument("--no-hostile", action="store_true", help="skip the hostile mix (serve_hostile.py)")
    ap.add_argument("--replot", action="store_true", help="only print the table and draw the figure from --out")
    args = ap.parse_args()
    if args.replot:
        with open(args.out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(table(rows))
        return plot(rows, args.figure)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("SIGTERM"))    # the finally blocks below still stop servers
    options = serve_options()
    batching = "--batching" in options
    modes = args.modes or (["static", "continuous"] if batching else ["current"])
    if not batching and set(modes) - {"current"}:
        sys.exit("this server has no --batching option: use --modes current")
    head = {**stamp(), "max_batch": args.max_batch}
    rng = random.Random(0)                  # the same max_tokens list for every mode and level
    max_tokens = [rng.randint(8, 96) for _ in range(max(args.requests or 0, 2 * max(args.clients), 8))]
    rows, servers = [], {}
    with tempfile.TemporaryDirectory(prefix="serve_load-") as tmp:
        checkpoint = args.checkpoint or train(tmp)
        try:
            for m in modes:
                flags = ["--max-batch", str(args.max_batch)] + (["--batching", m] if m != "current" else [])
                flags += ["--max-queue", str(args.max_queue)] if args.max_queue else []
                servers[m] = Server(checkpoint, flags, tmp)
                stream_one(servers[m], request_body(0, [8]))                  # warm-up
                print(f"{m}: serve {' '.join(flags)} on port {servers[m].port}, ranks {servers[m].ranks}")
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as out:
                for k, (rnd, clients) in enumerate(itertools.product(range(args.rounds), args.clients)):
                    for m in modes[:] if k % 2 == 0 else modes[::-1]:           # ABBA: drift falls on every mode
                        if not servers[m].alive():
                            print(f"the {m} server died; the rest of its levels are not run:\n"
                                  + servers[m].log_tail(), flush=True)
                            modes.remove(m)
                            continue
                        row = measure(servers[m], m, batching, rnd, clients, args, max_tokens)
                        rows.append({**row, "checkpoint": args.checkpoint or "trained: " + " ".join(TRAIN), **head})
                        out.write(json.dumps(rows[-1]) + "\n")
                        out.flush()
                        print(table(rows[-1:]).splitlines()[2], flush=True)
        finally:
            for s in servers.values():
                s.stop()
        print(table(rows))
        plot(rows, args.figure)
        if not args.no_hostile:
            import serve_hostile
            serve_hostile.run(checkpoint, options, tmp, out=os.path.join(os.path.dirname(args.out), "serve_hostile"))


def measure(s, mode, batching, rnd, clients, args, max_tokens):
    """One mode at one level: run_level's numbers, RSS before and after, the server's own counters."""
    load, rss = os.getloadavg()[0], s.rss()
    row = run_level(s, clients, args.requests or max(8, 2 * clients), max_tokens, args.level_seconds)
    label = mode if mode != "current" else "default" if batching else "static (current)"
    counters = {k: v for k, v in (metrics(s) or {}).items() if k.startswith("mpi_tp_") and "_bucket{" not in k}
    return {"mode": mode, "label": label, "round": rnd, **row, "rss_start": rss, "rss_end": s.rss(),
            "metrics": counters or None, "flags": s.flags, "loadavg": [load, os.getloadavg()[0]]}


if __name__ == "__main__":
    main()
