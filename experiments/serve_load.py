"""Load test of `mpi-tp serve`: streamed completions from 1 to 64 concurrent clients, loopback only.

    python experiments/serve_load.py                  # full, then the hostile mix (serve_hostile.py): ~3 min
    python experiments/serve_load.py --clients 1 4 --no-hostile --out /tmp/l.jsonl --figure /tmp/l.png  # quick
    python experiments/serve_load.py --replot         # the table and docs/figures/serve_load.png from the JSONL

Without --checkpoint a small model is trained first (4 blocks, C 128, 40 steps, ~15 s). Each mode
runs its own 2-rank server (`--max-batch 16`): `--batching static` and `continuous` where `serve
--help` lists --batching, else the current server, "static (current)". At N clients each sends
streamed completions one after another (temperature 1, seed = request index, max_tokens from 8..96
drawn with a fixed seed, the same for every mode) until --requests (max(8, 2N)) were sent or
--level-seconds passed; the modes take turns level by level in ABBA order (drift falls on both).
Per request: time to first token (send -> first text event), per-token latency ((last text event -
first) / (tokens - 1)); per mode and level: completion tokens (usage) / wall time, p50 / p99, errors
by status, RSS (both ranks' VmRSS; /metrics' process_resident_memory_bytes where served). One JSON
line per mode, level and round (machine, command, time). Servers always end: SIGTERM, SIGKILL after 30 s.
"""
import argparse
import contextlib
import http.client
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "serve_load.jsonl")
FIGURE = os.path.join(ROOT, "docs", "figures", "serve_load.png")
TRAIN = ["--steps", "40", "--n-layer", "4", "--n-embd", "128", "--n-head", "4", "--block-size", "128",
         "--batch-size", "8", "--sample-len", "0", "--eval-every", "1000", "--save-every", "40"]
PROMPTS = ["The ", "Once upon a time", "In the beginning ", "It was ", "MPI ", "Tensor parallel "]
SERVING = re.compile(r"^serving .+ on http://\[?([^\s\]]+)\]?:(\d+) \(tp=\d+\)$", re.MULTILINE)
REQUEST_TIMEOUT = 60.0                 # seconds any one socket operation of a client may take


def mpi_tp_command(ranks=2):
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [mpiexec or sys.exit("no mpiexec on PATH (pip install mpich)"), "-n", str(ranks), sys.executable,
            "-m", "mpi4py", "-m", "mpi_tp"]


def child_env():
    """This checkout's mpi_tp, one thread per rank, none of a parent MPI job's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    return env


def train(folder):
    out = os.path.join(folder, "run")
    print(f"training a small model into {out} ...", flush=True)
    subprocess.run(mpi_tp_command() + ["train", *TRAIN, "--out", out], cwd=ROOT, env=child_env(), check=True,
                   stdout=subprocess.DEVNULL, timeout=900)
    return os.path.join(out, "checkpoints")


def serve_options():
    """The options `mpi-tp serve --help` lists (--batching, --max-queue ... where the server has them)."""
    h = subprocess.run([sys.executable, "-m", "mpi_tp", "serve", "--help"], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=120, check=False).stdout
    return set(re.findall(r"--[a-z][a-z-]+", h))


def stamp():
    """The machine (mpi_tp.core.runtime.machine_text, in a child: no MPI here) and the last commit of mpi_tp/."""
    code = "from mpi_tp.core.runtime import machine_text; print(machine_text())"
    machine = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True,
                             text=True, timeout=120, check=False).stdout.strip()
    def git(*a):
        return subprocess.run(["git", "-C", ROOT, *a], capture_output=True, text=True, check=False).stdout.strip()
    commit = (git("log", "-1", "--format=%h", "--", "mpi_tp") or "?") + ("+dirty" if git("status", "--porcelain",
                                                                                        "--", "mpi_tp") else "")
    return {"machine": machine or "?", "commit": commit,
            "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def proc_children():
    kids = defaultdict(list)
    for d in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{d}/stat") as f:
            kids[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(d))
    return kids


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


class Server:
    """One `mpiexec -n 2 ... serve --port 0` job: its address, its ranks' RSS, a stop that always ends it."""

    def __init__(self, checkpoint, flags, logs, start_timeout=180.0):
        self.flags, self.ranks = list(flags), []
        fd, self.log = tempfile.mkstemp(prefix="serve-", suffix=".log", dir=logs)
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(mpi_tp_command() + ["serve", "--checkpoint", checkpoint, "--port", "0",
                                                             *self.flags], stdout=subprocess.PIPE, stderr=log,
                                         cwd=ROOT, env=child_env(), start_new_session=True, text=True)
        lines, reader = [], threading.Thread(target=lambda: lines.extend(self.proc.stdout), daemon=True)
        reader.start()                 # reads stdout to its end: the server's later lines never block it
        deadline = time.monotonic() + start_timeout
        while not (m := SERVING.search("".join(lines))):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start ({' '.join(self.flags)}):\n{self.log_tail()}")
            time.sleep(0.05)
        self.host, self.port = m.group(1), int(m.group(2))
        self.ranks = self.serve_ranks()

    def serve_ranks(self):
        kids, found, todo = proc_children(), [], [self.proc.pid]
        while todo:
            for p in kids[todo.pop()]:
                todo.append(p)
                with contextlib.suppress(OSError), open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read()
                    if b"mpi_tp" in cmd and b"serve" in cmd:
                        found.append(p)
        return sorted(found)

    def alive(self):
        return self.proc.poll() is None

    def log_tail(self, n=15):
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def rss(self):
        """MiB: every rank's VmRSS and peak (VmHWM) from /proc, and rank 0's own count from /metrics (or None)."""
        out = {"rss_mib": None, "hwm_mib": None, "metrics_rss_mib": None}
        with contextlib.suppress(OSError, StopIteration):
            out["rss_mib"] = round(sum(status_kib(p, "VmRSS") for p in self.ranks) / 1024, 1)
            out["hwm_mib"] = round(sum(status_kib(p, "VmHWM") for p in self.ranks) / 1024, 1)
        m = metrics(self)
        if m and "process_resident_memory_bytes" in m:
            out["metrics_rss_mib"] = round(m["process_resident_memory_bytes"] / 2**20, 1)
        return out

    def stop(self, timeout=30.0):
        """SIGTERM to mpiexec (it forwards it to every rank); SIGKILL to its process group and ranks after timeout."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for p in self.ranks:           # a rank its mpiexec left behind (checked by its command line: a pid is reused)
            with contextlib.suppress(OSError), open(f"/proc/{p}/cmdline", "rb") as f:
                if b"mpi_tp" in f.read():
                    os.kill(p, signal.SIGKILL)
        return self.proc.returncode


def get(server, path, timeout=10.0):
    """(status, headers, body) of one GET."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def metrics(server):
    """GET /metrics as {'name{labels}': value}, or None where the server has no /metrics."""
    try:
        status, _, body = get(server, "/metrics")
    except (OSError, http.client.HTTPException):
        return None
    if status != 200:
        return None
    out = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if m := re.match(r"([A-Za-z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)", line):
            with contextlib.suppress(ValueError):
                out[m.group(1)] = float(m.group(2))
    return out


def stream_one(server, body, timeout=REQUEST_TIMEOUT):
    """Send one streamed completion, read it to its end: status, TTFT and per-token latency in ms, tokens."""
    r = {"status": None, "ttft_ms": None, "tpot_ms": None, "tokens": 0}
    conn, resp, times, done = http.client.HTTPConnection(server.host, server.port, timeout=timeout), None, [], False
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        r["status"] = resp.status
        if resp.status != 200:
            r["retry_after"] = resp.getheader("Retry-After")
            return r
        while line := resp.readline():
            if not line.startswith(b"data: "):
                continue
            if (data := line[6:].strip()) == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if event["choices"][0].get("text"):
                times.append(time.perf_counter())
            if "usage" in event:
                r["tokens"] = event["usage"]["completion_tokens"]
    except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
        r["status"], r["error"] = r["status"] or type(e).__name__, type(e).__name__
    finally:
        if resp is not None:
            resp.close()               # Connection: close: the response holds the socket
        conn.close()
    if r["status"] == 200 and not done:
        r["status"] = "incomplete"
    if times:
        r["ttft_ms"] = 1e3 * (times[0] - t0)
    if len(times) > 1 and r["tokens"] > 1:
        r["tpot_ms"] = 1e3 * (times[-1] - times[0]) / (r["tokens"] - 1)
    return r


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
