"""Load imbalance of the experts over a training run: with the balance loss, without any balancing, with
DeepSeek-V3's aux-loss-free bias instead of the loss, and with both; and what each costs.

    python experiments/moe/moe_balance.py --steps 300  # the trainings at 2 ranks (mpiexec), then the figure
    python experiments/moe/moe_balance.py --steps 300 --bias-rates 0.001,0.01 --both-rate 0.001
    python experiments/moe/moe_balance.py --plot       # only redraw, from the raw file

`mpi-tp train` runs on the embedded default data (pydoc), 2 ranks, dp 2 = ep 2,
the same seed and model (L 2, C 64, 4 heads, S 64, B 8 sequences per replica,
E 8 experts per block, top-2, softmax router, dropless: --moe-capacity 0):
the load-balancing loss (--moe-aux-weight 0.01), no balancing (0), the bias
alone (--moe-aux-weight 0 --moe-bias-rate r, one run per r of --bias-rates)
and both (0.01 and --both-rate; none when 0). Each logged
step of OUT/metrics.jsonl (every --log-every steps) gives, per MoE block, the
tokens per expert of that step summed over the replicas and max / mean of
them; the cross-entropy and aux loss averaged over the logged window; and
step_s, the wall time per step averaged over the window. The loads of a logged
step are the choices after the bias (the metrics count what the router chose).

Raw: experiments/moe/results/moe_balance.jsonl, one line per run ("kind": "run": the
command, the environment, the load average before and after, the final
validation loss) and one per logged step ("kind": "step"). Figure:
docs/figures/moe_balance.png (left: imbalance, the mean over the MoE blocks,
against the step; right: step time against imbalance). The summary's "rank"
column: the busiest ep rank's tokens (its 4 experts) over the mean rank's, mean
over the blocks and the logged steps of the last third of the run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results", "moe_balance.jsonl")
FIGURE = os.path.join(ROOT, "docs", "figures", "moe_balance.png")
MODEL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block-size", "64", "--batch-size", "8",
         "--moe-experts", "8", "--moe-top-k", "2", "--moe-capacity", "0", "--dp", "2", "--ep", "2"]

def runs(bias_rates, both_rate):
    """(label, aux weight, bias rate) of every training."""
    out = [("aux 0.01", 0.01, 0.0), ("none", 0.0, 0.0)] + [(f"bias {r:g}", 0.0, r) for r in bias_rates]
    return out + ([(f"aux 0.01 + bias {both_rate:g}", 0.01, both_rate)] if both_rate else [])


def environment():
    """The machine, as `mpi-tp bench` records it (without starting MPI in this process)."""
    import mpi4py
    mpi4py.rc.initialize = False
    from mpi_tp.commands.bench import environment as bench_environment

    class One:
        def Get_size(self):
            return 2
    return bench_environment(One())


def train(label, weight, rate, steps, log_every, seed):
    out = tempfile.mkdtemp(prefix="moe_balance_")
    bias = ["--moe-bias-rate", str(rate)] if rate else []
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "mpi_tp", "train", *MODEL,
           "--moe-aux-weight", str(weight), *bias, "--steps", str(steps), "--log-every", str(log_every),
           "--eval-every", str(steps), "--seed", str(seed), "--sample-len", "0", "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    load0 = os.getloadavg()[0]
    print("$ " + " ".join(cmd[:3] + ["python"] + cmd[4:]), flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    load1 = os.getloadavg()[0]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    with open(os.path.join(out, "run.json")) as f:
        summary = json.load(f)
    shutil.rmtree(out)
    rows = [{"kind": "run", "run": label, "aux_weight": weight, "bias_rate": rate, "seed": seed, "steps": steps,
             "log_every": log_every, "command": " ".join(["mpiexec", "-n", "2", "python"] + cmd[4:-2]),
             "final_val_loss": summary["final_val_loss"], "train_seconds": summary["train_seconds"],
             "loadavg_start": load0, "loadavg_end": load1}]
    for e in lines:
        if "moe" not in e:
            continue                      # a val_loss line
        rows.append({"kind": "step", "run": label, "aux_weight": weight, "step": e["step"],
                     "imbalance": statistics.mean(m["imbalance"] for m in e["moe"]),
                     "imbalance_blocks": [m["imbalance"] for m in e["moe"]],
                     "tokens_per_expert": [m["tokens_per_expert"] for m in e["moe"]],
                     "dropped": sum(m["dropped"] for m in e["moe"]), "cross_entropy": e["cross_entropy"],
                     "aux_loss": e["aux_loss"], "loss": e["loss"], "step_s": e["step_s"], "comm_s": e["comm_s"]})
    return rows


def read_lines():
    with open(RESULTS) as f:
        return [json.loads(line) for line in f if line.strip()]


def late(s, what):
    """The mean of what(step) over the logged steps of the last third of the run."""
    tail = [r for r in s if r["step"] > 2 * s[-1]["step"] / 3]
    return statistics.mean(what(r) for r in tail)


def rank_imbalance(step):
    """The busiest ep rank's tokens over the mean rank's (2 ranks, E / 2 experts each), mean over the blocks."""
    def one(tokens):
        half = len(tokens) // 2
        loads = (sum(tokens[:half]), sum(tokens[half:]))
        return max(loads) / statistics.mean(loads)
    return statistics.mean(one(t) for t in step["tokens_per_expert"])


def summary(rows):
    out = ["run                   imbalance first  last  min  last third  rank  final ce  final val  "
           "median step ms  load"]
    for run in [r for r in rows if r["kind"] == "run"]:
        s = [r for r in rows if r["kind"] == "step" and r["run"] == run["run"]]
        out.append(f"{run['run']:21s} {s[0]['imbalance']:11.2f} {s[-1]['imbalance']:6.2f} "
                   f"{min(r['imbalance'] for r in s):5.2f} {late(s, lambda r: r['imbalance']):10.2f} "
                   f"{late(s, rank_imbalance):5.2f} {s[-1]['cross_entropy']:9.4f} "
                   f"{run['final_val_loss']:10.4f} {1000 * statistics.median(r['step_s'] for r in s):13.1f}"
                   f"   {run['loadavg_start']:.2f}-{run['loadavg_end']:.2f}")
    return "\n".join(out)


def plot(rows):
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))     # experiments/bench/scaling.py
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scaling import stamp
    head = rows[0]
    env = dict(head["environment"], mpi=" ".join(head["environment"]["mpi"].replace("Version:", "").split()))
    runs = [r for r in rows if r["kind"] == "run"]
    loads = [x for r in runs for x in (r["loadavg_start"], r["loadavg_end"])]
    each = runs[0]["command"].replace(f"--moe-aux-weight {runs[0]['aux_weight']}", "--moe-aux-weight W "
                                      "[--moe-bias-rate R]")
    rates = sorted({r["bias_rate"] for r in runs if r.get("bias_rate") and not r["aux_weight"]})
    both = [r["bias_rate"] for r in runs if r.get("bias_rate") and r["aux_weight"]]
    command = (f"python experiments/moe/moe_balance.py --steps {runs[0]['steps']}"
               + (f" --bias-rates {','.join(f'{x:g}' for x in rates)}" if rates else "")
               + (f" --both-rate {both[0]:g}" if both else "") + f"; each run: {each}")
    note = (stamp(env, command).replace("\n", " | ") + f"; 1-min load average {min(loads):.2f}-{max(loads):.2f} "
            "(what else ran beside it); raw: experiments/moe/results/moe_balance.jsonl")
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4.6), dpi=110)
    for run, color in zip(runs, ("C1", "C0", "C2", "C3", "C4", "C5", "C6")):
        s = [r for r in rows if r["kind"] == "step" and r["run"] == run["run"]]
        a0.plot([r["step"] for r in s], [r["imbalance"] for r in s], "o-", ms=3, color=color,
                label=f"{run['run']}: final ce {s[-1]['cross_entropy']:.3f}")
        a1.scatter([r["imbalance"] for r in s], [1000 * r["step_s"] for r in s], s=12, color=color,
                   label=f"{run['run']}: median {1000 * statistics.median(r['step_s'] for r in s):.0f} ms")
    a0.axhline(1.0, color="#888888", lw=0.8, ls=":")
    a0.set(xlabel="step", ylabel="max / mean tokens per expert (mean over blocks)",
           title="imbalance during training (dropless)")
    a1.set(xlabel="max / mean tokens per expert (that logged step)",
           ylabel="ms per step (mean over the logged window)", title="step time vs imbalance")
    for a in (a0, a1):
        a.legend(fontsize=7)
        a.title.set_fontsize(9)
    fig.suptitle("MoE balance: the aux loss (W 0.01), none, DeepSeek-V3's bias (rate R, no loss), both; E 8, "
                 "top-2, softmax router,\nep = dp = 2, L 2, C 64, S 64, B 8 per replica, pydoc bytes, same seed",
                 fontsize=9)
    wrapped = "\n".join(textwrap.wrap(note, int(18 * fig.get_figwidth())))
    fig.text(0.01, 0.005, wrapped, fontsize=5.5, va="bottom", color="#555555")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(FIGURE)
    plt.close(fig)
    return FIGURE


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", action="store_true", help="only redraw the figure from the raw file")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--bias-rates", default="0.001,0.01",
                    help="comma-separated --moe-bias-rate values, one run each without the loss")
    ap.add_argument("--both-rate", type=float, default=0.001, help="the bias rate of the run with the loss too "
                                                                   "(0: no such run)")
    args = ap.parse_args()
    if not args.plot:
        rows = []
        for label, w, rate in runs([float(r) for r in args.bias_rates.split(",") if r], args.both_rate):
            rows += train(label, w, rate, args.steps, args.log_every, args.seed)
        rows[0]["environment"] = environment()
        with open(RESULTS, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    rows = read_lines()
    print(summary(rows))
    print(f"wrote {os.path.relpath(plot(rows))}")


if __name__ == "__main__":
    main()
