"""The cost model against measurements: the runs on this machine, and the Megatron-LM paper's weak scaling.

    python experiments/planner/validate_costmodel.py            # tables on stdout, plots into docs/figures/
    python experiments/planner/validate_costmodel.py --out DIR  # plots somewhere else

(a) Step times measured here (experiments/vs_torch/results/intel-2026-11-30/torch_compare.jsonl: `mpi-tp bench`
    at shapes a, b, c, T = 1 and 2; results/dp_overlap.jsonl, beside this script: T = 1 x D = 2) against the
    model with the constants from `mpi-tp calibrate` (results/machine_1rank.json for one-rank
    jobs, machine_2ranks.json for two-rank jobs: a rank's GEMM and memory speed
    depend on how many ranks share the machine).
(b) Megatron-LM (Shoeybi et al. 2019, Table 1): GPT-2 models of 1.2B, 2.5B, 4.2B, 8.3B
    parameters on 1, 2, 4, 8 V100s of a DGX-2H with as many tensor-parallel ranks
    (T = 1, 2, 4, 8), B = 8 sequences of S = 1024, vocabulary 51,200, activation checkpointing;
    weak-scaling efficiency 100, 95, 82, 77 %. The dgx-2h preset predicts each point.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))            # the repository
sys.path.insert(0, ROOT)

from mpi_tp.planning.costmodel import Plan, Workload, step_time  # noqa: E402
from mpi_tp.planning.machines import PRESETS, Machine  # noqa: E402

# compare_torch.py's runs of the calibration's day: the steps measured beside the constants of results/
STEPS = os.path.join(HERE, "..", "vs_torch", "results", "intel-2026-11-30", "torch_compare.jsonl")
SHAPES = {"a": (256, 4, 4, 128, 8), "b": (512, 8, 4, 128, 8), "c": (1024, 16, 2, 128, 4)}
PAPER = [(1, 1536, 16, 40, 1.00), (2, 1920, 20, 54, 0.95), (4, 2304, 24, 64, 0.82), (8, 3072, 32, 72, 0.77)]


def megatron_flops(C, L, B=8, S=1024, V=51200):
    """Megatron-LM's FLOPs per step with activation checkpointing (Narayanan et al. 2021, eq. 3)."""
    return 96 * B * S * L * C * C * (1 + S / (6 * C) + V / (16 * L * C))


def paper_weak_scaling(m=PRESETS["dgx-2h"]):
    rows = []
    for T, C, H, L, eff in PAPER:
        w = Workload(L, C, H, 1024, 8, vocab=51200, attention="stored")     # Megatron 2019: the scores kept
        r = step_time(m, w, Plan(tp=T, micro_batch=8, recompute=True))
        rows.append({"gpus": T, "hidden": C, "layers": L, "paper": eff, "step_s": r["total"],
                     "tflops_per_gpu": megatron_flops(C, L) / T / r["total"] / 1e12, "tp_comm_s": r["tp_comm"]})
    base = rows[0]["tflops_per_gpu"]
    for r in rows:
        r["predicted"] = r["tflops_per_gpu"] / base
    return rows


def measured_here(results=None):
    results = results or os.path.join(HERE, "results")
    machines = {n: Machine.load(os.path.join(results, f"machine_{n}.json")) for n in ("1rank", "2ranks")}
    runs = {}
    with open(STEPS) as f:                                   # the calibration's day
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
    with open(os.path.join(results, "dp_overlap.jsonl")) as f:
        env = json.loads(f.readline())["environment"]
    rows = []
    for (shape, tp, dp, mode), times in sorted(runs.items(), key=str):
        C, H, L, S, B = SHAPES[shape]
        m = machines["1rank" if tp * dp == 1 else "2ranks"]
        pred = step_time(m, Workload(L, C, H, S, B * dp), Plan(tp=tp, dp=dp, micro_batch=B,
                                                                  overlap_dp=mode != "after"))["total"] * 1e3
        meas = statistics.median(times)
        rows.append({"shape": shape, "tp": tp, "dp": dp, "dp_mode": mode, "measured_ms": meas,
                     "predicted_ms": pred, "error": (pred - meas) / meas, "environment": env})
    return rows


def _label(r):
    return f"{r['shape']} tp{r['tp']} dp{r['dp']}" + (f" ({r['dp_mode']})" if r["dp_mode"] else "")


def plot_here(plt, rows, path):
    """Predicted against measured, one marker per shape and one colour per layout, named in a legend
    beside the axes (labels on the points overlap: the runs of one shape lie close together)."""
    markers, colors = {"a": "o", "b": "s", "c": "^"}, {}
    fig, ax = plt.subplots(figsize=(8.2, 4.6), dpi=110)
    for r in rows:
        layout = _label(r).split(" ", 1)[1]
        color = colors.setdefault(layout, f"C{len(colors)}")
        hollow = r["dp_mode"] == "after"              # (after) lies on (overlap): a ring around it
        ax.scatter(r["measured_ms"], r["predicted_ms"], marker=markers[r["shape"]], s=110 if hollow else 42,
                   facecolors="none" if hollow else color, edgecolors=color, linewidths=1.5,
                   label=f"{_label(r)}: {r['measured_ms']:.0f} ms, model {r['predicted_ms']:.0f} "
                         f"({100 * r['error']:+.1f}%)")
    top = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows) * 1.1
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="predicted = measured")
    ax.fill_between([0, top], [0, 0.8 * top], [0, 1.2 * top], color="grey", alpha=0.12, lw=0, label="within 20%")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured step (ms)", ylabel="predicted step (ms)",
           title="the cost model against `mpi-tp bench` on this machine")
    ax.set_aspect("equal")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False,
              title="shape (marker), layout (colour)", title_fontsize=7.5)
    env = rows[0]["environment"]
    mpi = " ".join(env["mpi"].split())
    fig.text(0.01, 0.01, f"measured: {env['cpu']}, {env['cores']} cores; {mpi}; BLAS {env['blas']['internal_api']} "
             f"{env['blas']['version']}; 1 thread/rank; {env['date']}\n"
             "steps: experiments/vs_torch/results/intel-2026-11-30/torch_compare.jsonl, "
             "experiments/planner/results/dp_overlap.jsonl; constants: machine_1rank.json, machine_2ranks.json\n"
             "python experiments/planner/validate_costmodel.py", fontsize=6, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def plots(here_rows, paper_rows, out=None):
    out = out or os.path.join(ROOT, "docs", "figures")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots; pip install matplotlib)")
        return
    os.makedirs(out, exist_ok=True)
    plot_here(plt, here_rows, os.path.join(out, "costmodel_here.png"))
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"), help="folder for the PNGs")
    args = ap.parse_args()
    here = measured_here()
    print("| run | measured ms | predicted ms | error |")
    print("|---|---|---|---|")
    for r in here:
        print(f"| {_label(r)} | {r['measured_ms']:.0f} | {r['predicted_ms']:.0f} | {100 * r['error']:+.1f}% |")
    print(f"largest error: {100 * max(abs(r['error']) for r in here):.1f}%\n")
    paper = paper_weak_scaling()
    print("| GPUs T | model | paper efficiency | predicted | difference | predicted TFLOP/s per GPU |")
    print("|---|---|---|---|---|---|")
    for r in paper:
        print(f"| {r['gpus']} | C={r['hidden']}, L={r['layers']} | {100 * r['paper']:.0f}% | {100 * r['predicted']:.1f}% | "
              f"{100 * (r['predicted'] - r['paper']):+.1f} points | {r['tflops_per_gpu']:.1f} |")
    plots(here, paper, args.out)


if __name__ == "__main__":
    main()
