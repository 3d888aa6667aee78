"""mpi_tp's cached decoding against PyTorch's KV-cached decoding of the same GPT, run back to back.

    python experiments/vs_torch/decode_vs_torch.py --peer ../shared/peers/torch_tp --rounds 3

For every round it runs, one right after the other, one BLAS thread per rank:
the peer's `decode.py` (PyTorch, one process, float32, a preallocated K/V
cache, F.scaled_dot_product_attention), `mpi-tp bench --inference` at T = 1
and at T = 2 (`mpiexec -n 2`), on shape c (C 1024, 16 heads, 2 blocks,
vocabulary 256), a prompt of 64 bytes and 64 decode steps, batches 1, 4, 16.
Each run's median milliseconds per decode step are appended to --out (JSON
lines); the table printed at the end gives, per batch, the median over rounds
and the ratios mpi_tp / PyTorch. The machine is shared and noisy: only ratios
from the same run mean something, and the load average is recorded.

The peer is a measuring stick, not a dependency: it needs torch
(`pip install torch==2.13.0`) in the Python given by --torch-python.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from compare_torch import run  # a command whose failure ends the comparison with its output

HERE = os.path.dirname(os.path.abspath(__file__))
BATCHES = (1, 4, 16)


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ours(T, args, env):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.jsonl")
        cmd = [sys.executable, "-m", "mpi_tp", "bench", "--inference", "--shape", "c", "--batch",
               *map(str, BATCHES), "--prompt-len", str(args.prompt), "--new-tokens", str(args.new), "--json", out]
        if T > 1:
            cmd = [shutil.which("mpiexec"), "-n", str(T)] + cmd
        run(cmd, env)
        return {r["batch"]: r["decode_ms_per_step"]["median"] for r in lines(out)}


def peer(args, env):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "p.jsonl")
        run([args.torch_python, "decode.py", "--config", "c", "--threads", "1", "--prompt", str(args.prompt),
             "--new", str(args.new), "--batches", *map(str, BATCHES), "--json", out], env, cwd=args.peer)
        return {r["batch"]: r["decode_ms_median"] for r in lines(out)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", default=os.path.join(HERE, "..", "..", "..", "shared", "peers", "torch_tp"))
    ap.add_argument("--torch-python", default=sys.executable, help="a Python with torch installed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode_vs_torch.jsonl"))
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.peer, "decode.py")):
        sys.exit(f"no decode.py in --peer {args.peer}: point it at shared/peers/torch_tp")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    rows = []
    open(args.out, "w").close()
    for rnd in range(args.rounds):
        for impl, fn in (("torch", lambda: peer(args, env)), ("mpi_tp T=1", lambda: ours(1, args, env)),
                         ("mpi_tp T=2", lambda: ours(2, args, env))):
            load = os.getloadavg()[0]
            ms = fn()
            row = {"round": rnd, "impl": impl, "decode_ms_per_step": ms, "loadavg_1min": [load, os.getloadavg()[0]],
                   "prompt": args.prompt, "new": args.new, "date": time.strftime("%Y-%m-%d %H:%M")}
            rows.append(row)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"round {rnd} {impl:11s}: " + ", ".join(f"B {b}: {v:.2f} ms" for b, v in ms.items()), flush=True)
    med = {impl: {b: statistics.median(r["decode_ms_per_step"][b] for r in rows if r["impl"] == impl)
                  for b in BATCHES} for impl in ("torch", "mpi_tp T=1", "mpi_tp T=2")}
    print("\n| batch | PyTorch (1 process) ms/step | mpi_tp T = 1 | mpi_tp T = 2 | T = 1 / PyTorch | T = 2 / PyTorch |")
    print("|---|---|---|---|---|---|")
    for b in BATCHES:
        t, one, two = med["torch"][b], med["mpi_tp T=1"][b], med["mpi_tp T=2"][b]
        print(f"| {b} | {t:.2f} | {one:.2f} | {two:.2f} | {one / t:.2f} | {two / t:.2f} |")
    print(f"\nraw: {os.path.relpath(args.out)}; medians over {args.rounds} rounds")


if __name__ == "__main__":
    main()
