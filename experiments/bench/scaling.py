"""Strong and weak scaling, the per-step breakdown, and memory per rank against T, with plots.

    python experiments/bench/scaling.py                  # T = 1 and 2 (this machine has 2 real cores)
    python experiments/bench/scaling.py --ranks 1 2 4 8  # on a node with the cores for it
    python experiments/bench/scaling.py --replot         # the plots again from experiments/bench/results/scaling.jsonl

Each point is one `mpi-tp bench` job (mpiexec -n T, one BLAS thread per rank),
written to experiments/bench/results/scaling.jsonl and .csv; the plots go to
docs/figures/scaling_*.png, each stamped with machine, MPI, BLAS, threads, date
and this command. On 2 cores, T = 4 would oversubscribe the machine: that is
not a scaling measurement, so the default stops at 2.

- Strong scaling: one model (C 1024, 16 heads, 2 layers, S 128, B 4, shape c of
  the benchmark) at every T: speed-up and efficiency against T = 1.
- Weak scaling, the Megatron-LM paper's rule scaled down: each doubling of T
  multiplies the hidden size by 1.25 and the layers by 1.25 (heads follow the
  hidden size, 64 per head), so the parameters per rank stay about the same
  (x1.95 per doubling, as the paper's 1.2B -> 2.5B -> 4.2B -> 8.3B); efficiency =
  model FLOP/s per rank against T = 1.
- Breakdown: forward, backward, optimizer, and each collective kind, per step;
  communication against the analytical volume of Narayanan et al. 2021: each
  device sends 8 B S C (T-1)/T values per layer per micro-batch (4 ring
  all-reduces of B S C values); in float32, 4 bytes each. The embedding, the
  tied head and the loss add two more all-reduces of b s h and two small ones
  (docs/tensor_parallelism.md).
- Memory: peak resident memory and model state per rank for a model whose
  weights and AdamW state dominate (C 2048, 16 heads, 2 layers, S 64, B 2).
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STRONG = (1024, 16, 2, 128, 4)
MEMORY = (2048, 16, 2, 64, 2)


def weak_shape(T):
    """Megatron's weak-scaling rule, scaled down: from C 512, 4 layers at T = 1."""
    k = {1: 0, 2: 1, 4: 2, 8: 3, 16: 4}[T]
    C = round(512 * 1.25 ** k / 64) * 64
    return (C, C // 64, round(4 * 1.25 ** k), 128, 8)


def bench(T, shape, steps):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.jsonl")
        cmd = [sys.executable, "-m", "mpi_tp", "bench", "--custom", ",".join(map(str, shape)), "--steps", str(steps),
               "--json", out]
        if T > 1:
            cmd = ["mpiexec", "-n", str(T)] + cmd
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, cwd=ROOT)
        with open(out) as f:
            return json.loads(f.read().splitlines()[-1])


def stamp(env, command):
    blas = env["blas"]
    gemm = "; linear layers' GEMMs by MKL" if env.get("gemm") == "mkl" else ""      # mpi_tp.core.blas's choice
    return (f"{env['cpu']}, {env['cores']} cores; {' '.join(env['mpi'].split())}; BLAS {blas.get('internal_api')} "
            f"{blas.get('version')} ({blas.get('architecture')}){gemm}; 1 thread/rank; {env['date']}\n{command}")


def plot(rows, command, figs=None):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plots; pip install matplotlib)")
        return []
    figs = figs or os.path.join(ROOT, "docs", "figures")
    os.makedirs(figs, exist_ok=True)
    note = stamp(rows[0]["environment"], command)
    written = []

    def save(fig, name):
        fig.text(0.01, 0.005, note, fontsize=5.5, va="bottom")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        path = os.path.join(figs, name)
        fig.savefig(path)
        written.append(path)

    for kind, title in (("strong", "strong scaling, C 1024 / 16 heads / 2 layers"),
                        ("weak", "weak scaling (Megatron's rule, scaled down)")):
        sel = [r for r in rows if r["experiment"] == kind]
        if not sel:
            continue
        T = [r["tp"] for r in sel]
        fig, ax = plt.subplots(1, 2, figsize=(8, 3.4), dpi=110)
        if kind == "strong":
            base = sel[0]["step_ms"]["median"]
            ax[0].plot(T, [base / r["step_ms"]["median"] for r in sel], "o-", label="measured")
            ax[0].plot(T, T, "k--", lw=0.8, label="linear")
            ax[0].set(xlabel="ranks T", ylabel="speed-up", title=title, xticks=T)
            ax[1].plot(T, [100 * base / r["step_ms"]["median"] / t for r, t in zip(sel, T)], "o-")
            ax[1].set(xlabel="ranks T", ylabel="efficiency (%)", ylim=(0, 110), xticks=T)
        else:
            base = sel[0]["model_gflops_per_rank"]
            ax[0].plot(T, [r["step_ms"]["median"] for r in sel], "o-")
            ax[0].set(xlabel="ranks T", ylabel="step (ms)", title=title, xticks=T)
            ax[1].plot(T, [100 * r["model_gflops_per_rank"] / base for r in sel], "o-")
            ax[1].set(xlabel="ranks T", ylabel="weak-scaling efficiency (%)", ylim=(0, 110), xticks=T)
        ax[0].legend() if kind == "strong" else None
        save(fig, f"scaling_{kind}.png")
    sel = [r for r in rows if r["experiment"] == "strong"]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    parts = ["forward compute", "backward compute", "optimizer", "communication"]
    bottoms = [0.0] * len(sel)
    for part in parts:
        vals = []
        for r in sel:
            comm = sum(r["comm_ms"].values())
            share = {"forward compute": r["phases_ms"]["forward"] - comm / 2,
                     "backward compute": r["phases_ms"]["backward"] - comm / 2,
                     "optimizer": r["phases_ms"]["optimizer"], "communication": comm}[part]
            vals.append(max(share, 0))
        ax.bar([str(r["tp"]) for r in sel], vals, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for i, total in enumerate(bottoms):                   # the step's total above each bar
        ax.text(i, total, f"{total:.0f} ms", ha="center", va="bottom", fontsize=8)
    # room above the tallest bar for its total, and the legend beside the bars, not on them
    ax.set_ylim(0, max(bottoms, default=1) * 1.12)
    ax.set(xlabel="ranks T", ylabel="ms per step", title="per-step breakdown, C 1024\n(communication: time in collectives)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    save(fig, "scaling_breakdown.png")
    sel = [r for r in rows if r["experiment"] == "memory"]
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=110)
    ax.plot([r["tp"] for r in sel], [r["peak_rss_mb_per_rank"] for r in sel], "o-", label="peak RSS")
    ax.plot([r["tp"] for r in sel], [r["state_mb_per_rank"] for r in sel], "s--", label="weights+grads+AdamW")
    ax.set(xlabel="ranks T", ylabel="MB per rank", title="memory per rank, C 2048 / 2 layers", xticks=[r["tp"] for r in sel])
    ax.legend()
    save(fig, "scaling_memory.png")
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--replot", action="store_true",
                    help="no runs: draw the plots again from experiments/bench/results/scaling.jsonl")
    ap.add_argument("--figures", default=os.path.join(ROOT, "docs", "figures"), help="folder for the PNGs")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(HERE, "results", "scaling.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        command = rows[0]["command"].strip() + "  (plots redrawn by python experiments/bench/scaling.py --replot)"
        for path in plot(rows, command, args.figures):                      # the measuring command, and this one
            print("wrote", path)
        return
    command = "python experiments/bench/scaling.py " + " ".join(sys.argv[1:])
    rows = []
    for T in args.ranks:
        for experiment, shape in (("strong", STRONG), ("weak", weak_shape(T)), ("memory", MEMORY)):
            r = bench(T, shape, args.steps if experiment != "memory" else 3)
            r["experiment"] = experiment
            C, _, L, S, B = shape
            per_layer = 8 * B * S * C * (T - 1) / T * 4           # Narayanan's volume, float32 values
            r["narayanan_bytes_per_step"] = per_layer * L
            rows.append(r)
            print(f"T={T} {experiment:<6} {shape}: {r['step_ms']['median']:.1f} ms, "
                  f"{100 * r['fraction_of_gemm_peak']:.0f}% of GEMM peak, {r['peak_rss_mb_per_rank']:.0f} MB/rank",
                  flush=True)
    results = os.path.join(HERE, "results")
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "scaling.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(dict(r, command=command)) + "\n")
    with open(os.path.join(results, "scaling.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["experiment", "T", "n_embd", "n_head", "n_layer", "seq", "batch", "step_ms", "tokens_per_s",
                    "model_gflops_per_rank", "fraction_of_gemm_peak", "comm_bytes", "narayanan_bytes",
                    "peak_rss_mb", "state_mb"])
        for r in rows:
            s = r["shape"]
            w.writerow([r["experiment"], r["tp"], s["n_embd"], s["n_head"], s["n_layer"], s["block_size"], s["batch"],
                        f"{r['step_ms']['median']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['model_gflops_per_rank']:.2f}",
                        f"{r['fraction_of_gemm_peak']:.3f}", r["comm_bytes_per_step"], int(r["narayanan_bytes_per_step"]),
                        f"{r['peak_rss_mb_per_rank']:.0f}", f"{r['state_mb_per_rank']:.0f}"])
    for path in plot(rows, command, args.figures):
        print("wrote", path)
    print(f"wrote {results}/scaling.jsonl and scaling.csv ({time.strftime('%Y-%m-%d %H:%M')})")


if __name__ == "__main__":
    main()
