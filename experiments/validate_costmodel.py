"""The cost model against measurements: the runs on this machine, and the Megatron-LM paper's weak scaling.

    python experiments/validate_costmodel.py            # tables on stdout, plots into docs/figures/

(a) Step times measured here (experiments/results/torch_compare.jsonl: `mpi-tp bench`
    at shapes a, b, c, T = 1 and 2; dp_overlap.jsonl: T = 1 x D = 2) against the
    model with the constants from `mpi-tp calibrate` (machine_1rank.json for one-rank
    jobs, machine_2ranks.json for two-rank jobs: a rank's GEMM and memory speed
    depend on how many ranks share the machine).
(b) Megatron-LM (Shoeybi et al. 2019, Table 1): GPT-2 models of 1.2B, 2.5B, 4.2B, 8.3B
    parameters on 1, 2, 4, 8 V100s of a DGX-2H with 8-way... n-way tensor
    parallelism, batch 8, sequence 1024, vocabulary 51,200, activation checkpointing;
    weak-scaling efficiency 100, 95, 82, 77 %. The dgx-2h preset predicts each point.
"""
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpi_tp.planning.costmodel import Layout, Workload, step_time  # noqa: E402
from mpi_tp.planning.machines import PRESETS, Machine  # noqa: E402

SHAPES = {"a": (256, 4, 4, 128, 8), "b": (512, 8, 4, 128, 8), "c": (1024, 16, 2, 128, 4)}
PAPER = [(1, 1536, 16, 40, 1.00), (2, 1920, 20, 54, 0.95), (4, 2304, 24, 64, 0.82), (8, 3072, 32, 72, 0.77)]


def megatron_flops(h, L, B=8, s=1024, V=51200):
    """Megatron-LM's FLOPs per step with activation checkpointing (Narayanan et al. 2021, eq. 3)."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def paper_weak_scaling(m=PRESETS["dgx-2h"]):
    rows = []
    for t, h, a, L, eff in PAPER:
        w = Workload(L, h, a, 1024, 8, vocab=51200)
        r = step_time(m, w, Layout(tp=t, micro_batch=8, recompute=True))
        rows.append({"gpus": t, "hidden": h, "layers": L, "paper": eff, "step_s": r["total"],
                     "tflops_per_gpu": megatron_flops(h, L) / t / r["total"] / 1e12, "tp_comm_s": r["tp_comm"]})
    base = rows[0]["tflops_per_gpu"]
    for r in rows:
        r["predicted"] = r["tflops_per_gpu"] / base
    return rows


def measured_here(results=os.path.join(HERE, "results")):
    machines = {n: Machine.load(os.path.join(results, f"machine_{n}.json")) for n in ("1rank", "2ranks")}
    runs = {}
    with open(os.path.join(results, "torch_compare.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r["impl"] == "mpi_tp":
                runs.setdefault((r["shape"], r["T"], 1, None), []).append(r["step_ms"])
    with open(os.path.join(results, "dp_overlap.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("dp", 1) > 1 and r["dp_mode"] != "none":
                name = {256: "a", 512: "b", 1024: "c"}[r["shape"]["n_embd"]]
                runs.setdefault((name, 1, r["dp"], r["dp_mode"]), []).append(r["step_ms"]["median"])
    rows = []
    for (shape, tp, dp, mode), times in sorted(runs.items(), key=str):
        C, H, L, S, B = SHAPES[shape]
        m = machines["1rank" if tp * dp == 1 else "2ranks"]
        pred = step_time(m, Workload(L, C, H, S, B * dp), Layout(tp=tp, dp=dp, micro_batch=B,
                                                                  overlap_dp=mode != "after"))["total"] * 1e3
        meas = statistics.median(times)
        rows.append({"shape": shape, "tp": tp, "dp": dp, "dp_mode": mode, "measured_ms": meas,
                     "predicted_ms": pred, "error": (pred - meas) / meas})
    return rows


def plots(here_rows, paper_rows, out=os.path.join(os.path.dirname(HERE), "docs", "figures")):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots; pip install matplotlib)")
        return
    os.makedirs(out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 4), dpi=110)
    x = [r["measured_ms"] for r in here_rows]
    y = [r["predicted_ms"] for r in here_rows]
    ax.scatter(x, y)
    for r in here_rows:
        ax.annotate(f"{r['shape']} {r['tp']}x{r['dp']}" + (f" {r['dp_mode']}" if r["dp_mode"] else ""),
                    (r["measured_ms"], r["predicted_ms"]), fontsize=7)
    lim = [0, max(x + y) * 1.1]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.plot(lim, [v * 1.2 for v in lim], ":", color="grey", lw=0.8)
    ax.plot(lim, [v * 0.8 for v in lim], ":", color="grey", lw=0.8)
    ax.set(xlabel="measured step (ms)", ylabel="predicted step (ms)", title="cost model vs this machine (+-20%)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "costmodel_here.png"))
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=110)
    g = [r["gpus"] for r in paper_rows]
    ax.plot(g, [100 * r["paper"] for r in paper_rows], "o-", label="Megatron-LM paper (Table 1)")
    ax.plot(g, [100 * r["predicted"] for r in paper_rows], "s--", label="cost model, dgx-2h preset")
    ax.set(xlabel="GPUs (tensor-parallel size)", ylabel="weak-scaling efficiency (%)", xticks=g, ylim=(60, 105))
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "costmodel_megatron.png"))
    print(f"plots: {out}/costmodel_here.png, {out}/costmodel_megatron.png")


def main():
    here = measured_here()
    print("| run | measured ms | predicted ms | error |")
    print("|---|---|---|---|")
    for r in here:
        label = f"{r['shape']} tp{r['tp']} dp{r['dp']}" + (f" ({r['dp_mode']})" if r["dp_mode"] else "")
        print(f"| {label} | {r['measured_ms']:.0f} | {r['predicted_ms']:.0f} | {100 * r['error']:+.1f}% |")
    print(f"largest error: {100 * max(abs(r['error']) for r in here):.1f}%\n")
    paper = paper_weak_scaling()
    print("| GPUs | model | paper efficiency | predicted | difference | predicted TFLOP/s per GPU |")
    print("|---|---|---|---|---|---|")
    for r in paper:
        print(f"| {r['gpus']} | h={r['hidden']}, L={r['layers']} | {100 * r['paper']:.0f}% | {100 * r['predicted']:.1f}% | "
              f"{100 * (r['predicted'] - r['paper']):+.1f} points | {r['tflops_per_gpu']:.1f} |")
    plots(here, paper)


if __name__ == "__main__":
    main()
