"""The README model trained at fp32, bf16 and fp16: loss curves, validation loss and time per step.

    python experiments/training/precision_curves.py               # 3 runs of `mpiexec -n 2 mpi-tp train`
    python experiments/training/precision_curves.py --replot      # redraw from results/precision_curves.jsonl
    python experiments/training/precision_curves.py --ranks 2 -- --steps 300 --n-embd 64   # options for train
    python experiments/training/precision_curves.py --gradients   # where the fp32 gradients sit against fp16's range

Each run is the README's main job (`mpiexec -n 2 mpi-tp train`, its defaults) with --precision P and
no final sample, in a fresh folder under /tmp. The script reads each run's metrics.jsonl (the training
loss every 10 steps, the validation loss every 250 steps and at the end, fp16's skipped steps) and
run.json (validation loss, tokens/s, the machine), appends one line per run to
results/precision_curves.jsonl, and draws docs/figures/precision_loss.png from those lines, stamped
with the machine and the command. --gradients trains the same model serially in fp32 for 300
steps and writes, at steps 1, 10, 100 and 300, the share of gradient entries below fp16's smallest
subnormal (2^-24: they become 0) and below its smallest normal (2^-14: they lose bits), to
results/precision_gradients.jsonl (docs/precision.md's loss-scaling section). On a CPU, 16 bits are for numerics and memory, not speed: NumPy has
no 16-bit GEMM, so every product widens its operands to fp32 and rounds its result (core/kernels_half.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
RESULTS = os.path.join(HERE, "results", "precision_curves.jsonl")
FIGURE = os.path.join(ROOT, "docs", "figures", "precision_loss.png")
FORMATS = ("fp32", "bf16", "fp16")


def run(precision: str, ranks: int, extra: list[str]) -> dict:
    """One training run; its curve and summary as a results line."""
    out = tempfile.mkdtemp(prefix=f"precision-{precision}-")
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "mpi_tp", "train",
           "--precision", precision, "--sample-len", "0", "--out", os.path.join(out, "run"), *extra]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(out, "run", "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(out, "run", "run.json")) as f:
        summary = json.load(f)
    shutil.rmtree(out)
    return {"precision": precision, "command": " ".join(["mpiexec", "-n", str(ranks), "mpi-tp", "train",
                                                          "--precision", precision, *extra]),
            "train": [(m["step"], m["loss"]) for m in metrics if "loss" in m and "skipped" not in m],
            "val": [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m],
            "skipped": [(m["step"], m["loss_scale"]) for m in metrics if "skipped" in m],
            "final_val_loss": summary["final_val_loss"], "tokens_per_s": summary["tokens_per_s"],
            "train_seconds": summary["train_seconds"], "loss_scale": summary.get("loss_scale"),
            "load_average_1min_at_end": os.getloadavg()[0]}      # > ranks: something else shared the cores


def bench_environment() -> dict:
    """The machine as `mpi-tp bench` stamps it (CPU, cores, BLAS, MPI library, date)."""
    from mpi4py import MPI

    from mpi_tp.commands.bench.yardsticks import environment
    return environment(MPI.COMM_SELF)


def gradient_magnitudes(steps=(1, 10, 100, 300)) -> list[dict]:
    """The README model in fp32, one rank: its whole gradient's magnitudes against fp16's range."""
    import numpy
    from mpi4py import MPI

    from mpi_tp.training.build import build
    from mpi_tp.training.config import TrainConfig
    from mpi_tp.training.loop import run_step
    from mpi_tp.training.optim import lr_at
    cfg = TrainConfig(out=os.path.join(tempfile.mkdtemp(prefix="precision-gradients-"), "run"), sample_len=0)
    run, rows = build(cfg, MPI.COMM_SELF), []
    try:
        for step in range(1, max(steps) + 1):
            run_step(run, step, lr_at(step - 1, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio))
            if step in steps:
                g = numpy.abs(numpy.concatenate([x.ravel() for x in run.opt.grads()]))
                rows.append({"step": step, "entries": int(g.size), "below_fp16_subnormal": float(numpy.mean(g < 2.0 ** -24)),
                             "below_fp16_normal": float(numpy.mean(g < 2.0 ** -14)), "median": float(numpy.median(g)),
                             "max": float(g.max()), "environment": bench_environment()})
                print(f"step {step}: {100 * rows[-1]['below_fp16_subnormal']:.2f}% of entries below 2^-24, "
                      f"{100 * rows[-1]['below_fp16_normal']:.1f}% below 2^-14; median {rows[-1]['median']:.2e}")
    finally:
        run.close()
        shutil.rmtree(os.path.dirname(cfg.out))
    return rows


def plot(rows: list[dict], command: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot; pip install matplotlib)")
        return
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))     # experiments/bench/scaling.py
    from scaling import stamp
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(10, 4.2))
    base = dict(next(r for r in rows if r["precision"] == "fp32")["train"])
    for row in rows:
        steps, losses = zip(*row["train"])
        load = row.get("load_average_1min_at_end")
        line, = ax.plot(steps, losses, lw=1, label=f"{row['precision']}: validation {row['final_val_loss']:.4f}, "
                                                   f"{row['tokens_per_s']:,.0f} tok/s" + (f" (load {load:.1f})" if load else ""))
        vs, vl = zip(*row["val"])
        ax.plot(vs, vl, "o", color=line.get_color(), ms=4)
        both = [(s, v - base[s]) for s, v in row["train"] if s in base]
        dx.plot(*zip(*both), lw=1, color=line.get_color(), label=row["precision"])
        for step, _ in row["skipped"]:
            for a in (ax, dx):
                a.axvline(step, color=line.get_color(), lw=0.5, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte); dots: validation")
    ax.set_title("The README model at fp32, bf16 and fp16 (fp32 masters)", fontsize=9)
    ax.legend(fontsize=7)
    ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
    dx.axhline(0, color="gray", lw=0.5)
    dx.set_xlabel("step")
    dx.set_ylabel("training loss minus fp32's at the same step")
    dx.set_title("The difference (dotted: an fp16 step skipped for an overflow)", fontsize=9)
    dx.legend(fontsize=7)
    fig.text(0.01, 0.005, stamp(rows[0]["environment"], command), fontsize=5.5, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    os.makedirs(os.path.dirname(FIGURE), exist_ok=True)
    fig.savefig(FIGURE, dpi=130)
    print(f"wrote {FIGURE}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--replot", action="store_true", help="redraw from the results file, run nothing")
    ap.add_argument("--gradients", action="store_true", help="only the fp32 gradients' magnitudes (1 rank)")
    ap.add_argument("train_options", nargs="*", help="more `mpi-tp train` options, after --")
    args = ap.parse_args()
    command = "python experiments/training/precision_curves.py " + " ".join(sys.argv[1:])
    if args.gradients:
        with open(os.path.join(HERE, "results", "precision_gradients.jsonl"), "w") as f:
            f.writelines(json.dumps({**row, "script": command}) + "\n" for row in gradient_magnitudes())
        return
    if not args.replot:
        rows = [run(p, args.ranks, args.train_options) for p in FORMATS]
        env = bench_environment()           # after the runs: this process joins MPI only now (as a singleton)
        rows = [{**row, "environment": env} for row in rows]
        os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
        with open(RESULTS, "w") as f:
            f.writelines(json.dumps({**row, "script": command}) + "\n" for row in rows)
    with open(RESULTS) as f:
        rows = [json.loads(line) for line in f]
    fp32 = next(r for r in rows if r["precision"] == "fp32")
    for r in rows:
        print(f"{r['precision']}: validation {r['final_val_loss']:.4f} ({100 * (r['final_val_loss'] / fp32['final_val_loss'] - 1):+.2f}% "
              f"of fp32), {r['tokens_per_s']:,.0f} tok/s ({r['train_seconds']:.0f} s, load {r.get('load_average_1min_at_end', 0):.1f}), "
              f"skipped {len(r['skipped'])}")
    plot(rows, rows[0].get("script", command))


if __name__ == "__main__":
    main()
