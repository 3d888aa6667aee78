"""mpi_tp against PyTorch's own tensor parallelism on the same shapes, run back to back.

    python experiments/vs_torch/compare_torch.py --peer ../shared/peers/torch_tp \\
        --torch-python /tmp/torchpeer/venv/bin/python --repeats 3

For every repeat, shape (a, b, c) and T (1, 2) it runs `mpi-tp bench` and the
peer's `gpt_tp.py` (DTensor plan, T = 2 via torchrun) one right after the
other, one BLAS thread per rank, and appends both results to --out (JSON
lines). It then prints a Markdown table: the median over repeats of each run's
median step time, their ratio mpi_tp / PyTorch, and the median of each repeat's
own ratio (its two runs were back to back). The machine is shared and
noisy, so only ratios from the same run are meaningful.

The peer (a PyTorch CPU/gloo GPT with the same architecture) is a measuring
stick, not a dependency: its venv is made by its own run.sh
(`pip install torch==2.13.0 numpy` into /tmp/torchpeer/venv).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def run(cmd, env, cwd=None):
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")


def last_json(path):
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def ours(shape, T, steps, env):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.jsonl")
        cmd = [sys.executable, "-m", "mpi_tp", "bench", "--shape", shape, "--steps", str(steps), "--json", out]
        if T > 1:
            cmd = [shutil.which("mpiexec"), "-n", str(T)] + cmd
        run(cmd, env)
        r = last_json(out)
    return {"impl": "mpi_tp", "shape": shape, "T": T, "step_ms": r["step_ms"]["median"],
            "phases_ms": r["phases_ms"], "gemm_peak": r["gemm_peak_gflops_per_rank"],
            "fraction_of_peak": r["fraction_of_gemm_peak"], "rss_mb": r["peak_rss_mb_per_rank"],
            "comm_ms": r["comm_ms"], "allreduce_BSC_ms": r["allreduce_BSC_ms"]}


def torch(shape, T, steps, peer, py, env):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.jsonl")
        script = os.path.join(peer, "gpt_tp.py")
        args = ["--config", shape, "--threads", "1", "--steps", str(steps), "--gemm-peak", "--json", out]
        if T == 1:
            cmd = [py, script] + args
        else:
            cmd = [os.path.join(os.path.dirname(py), "torchrun"), "--standalone", f"--nproc_per_node={T}",
                   script, "--impl", "dtensor"] + args
        run(cmd, env)
        r = last_json(out)
    return {"impl": "torch-dtensor" if T > 1 else "torch", "shape": shape, "T": T,
            "step_ms": 1e3 * r["step_median_s"], "gemm_peak": r["gemm2048_gflops_median"],
            "phases_ms": {"forward": 1e3 * r["fwd_median_s"], "backward": 1e3 * r["bwd_median_s"],
                          "optimizer": 1e3 * r["opt_median_s"]}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "peers", "torch_tp"))
    ap.add_argument("--torch-python", default="/tmp/torchpeer/venv/bin/python")
    ap.add_argument("--shapes", nargs="+", default=["a", "b", "c"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="experiments/vs_torch/results/torch_compare.jsonl")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.peer, "gpt_tp.py")) or not os.path.isfile(args.torch_python):
        sys.exit(f"need the peer ({args.peer}/gpt_tp.py) and its python ({args.torch_python}); see --help")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows = []
    for rep in range(args.repeats):
        for shape in args.shapes:
            for T in args.ranks:
                for fn in (lambda: ours(shape, T, args.steps, env),
                           lambda: torch(shape, T, args.steps, args.peer, args.torch_python, env)):
                    r = dict(fn(), repeat=rep)
                    rows.append(r)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
                    print(f"repeat {rep} shape {shape} T={T} {r['impl']}: {r['step_ms']:.1f} ms", flush=True)
    print("\n| shape | T | mpi_tp ms | PyTorch ms | ratio | ratio by repeat (median) | mpi_tp % of GEMM peak |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        for T in args.ranks:
            mine = [r for r in rows if r["shape"] == shape and r["T"] == T and r["impl"] == "mpi_tp"]
            peer = [r for r in rows if r["shape"] == shape and r["T"] == T and r["impl"] != "mpi_tp"]
            a = statistics.median(r["step_ms"] for r in mine)
            b = statistics.median(r["step_ms"] for r in peer)
            frac = statistics.median(r["fraction_of_peak"] for r in mine)
            # each repeat's two runs were back to back: their ratio is the least disturbed by the machine's drift
            paired = statistics.median(m["step_ms"] / p["step_ms"] for m, p in zip(mine, peer))
            print(f"| {shape} | {T} | {a:.0f} | {b:.0f} | {a / b:.2f} | {paired:.2f} | {100 * frac:.0f}% |")


if __name__ == "__main__":
    main()
