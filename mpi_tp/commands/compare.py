"""`mpi-tp compare A B`: are two runs (or checkpoints) the same model with the same numbers? What a user runs
after a conversion, a layout change or a resume at another world size.

    mpi-tp compare runs/tp2 runs/dp2                     # loss curves, parameters by name, next-token KL
    mpi-tp compare runs/a/checkpoints gpt2-folder --windows 4 --data notes.txt --fail-above 1e-6
    mpiexec -n 2 mpi-tp compare runs/a runs/b --plot ab.png --optim --json

Three parts, each where both inputs have it (mpi_tp.commands.compare_sources finds and reads them):
1. loss curves (run folders' metrics.jsonl): the steps both logged, the differences, the largest absolute and
   relative one and where; --plot draws both curves and their difference, stamped with the machine.
2. tensors by name (the latest checkpoints, or --step-a / --step-b): max |A - B| per tensor and that relative
   to the tensor's largest magnitude, worst first (--top), names only in one; optimizer state with --optim.
3. next-token distributions (mpi_tp.inference.divergence): both models, one after the other, on the same
   windows of A's validation data (or --data), tensor-parallel over the job's ranks as eval runs them:
   KL(A||B) per position (mean, max) and how often both put the same token first. --windows 0 skips it.

Exit status 0; 1 with --fail-above X when the largest relative tensor difference or the mean KL is above X
(a gate for a conversion in CI); 2 for bad input (one line).
"""
from __future__ import annotations

import json
import math
import sys

from mpi_tp.checkpoint.read import open_checkpoint
from mpi_tp.commands.common import model_ids, on_rank0
from mpi_tp.commands.compare_sources import (
    compare_curves,
    compare_tensors,
    curves,
    find,
    same_model,
)
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup, machine_text


def finite(value):
    """The report with every non-finite number (a tensor whose shapes differ: an infinite difference) as
    null, so that --json prints strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def validation_tokens(a, data: str | None):
    """(token ids, what they are): --data's, else A's training data's validation part (its train options
    name it), as A's model reads them."""
    from mpi_tp.training.data import load_corpus, split
    with open_checkpoint(a.checkpoint) as ck:
        tok, V, S = ck.tokenizer(), int(ck.meta["config"]["vocab_size"]), int(ck.meta["config"]["block_size"])
        trained = ck.meta.get("train_config") or (a.run or {}).get("config") or {}
    if data is not None:
        corpus, what = load_corpus(data), data
    elif trained.get("data"):
        corpus = load_corpus(trained["data"])
        corpus.data = split(corpus, trained.get("val_fraction", 0.1))[1]
        what = f"{trained['data']}, validation part"
    else:
        raise UserError(f"compare: A ({a.path}) does not say what data it was trained on: pass --data FILE")
    tokens = model_ids(corpus, tok, V, what, f"the model at {a.checkpoint}")
    if tokens.size < S + 1:             # said before any model loads
        raise UserError(f"compare: {what} has {tokens.size} tokens; one window needs {S + 1} (block_size + 1): "
                        "pass a longer --data, or --windows 0")
    return tokens, what


def compare_files(a, b, config, args) -> dict:
    """Parts 1 and 2 (rank 0 reads the files)."""
    report = {"a": a.describe(), "b": b.describe(), "config": config, "loss": {}}
    if a.metrics and b.metrics:
        ca, cb = curves(a.metrics), curves(b.metrics)
        for key in ("loss", "val_loss"):
            if ca[key] and cb[key] and set(ca[key]) & set(cb[key]):
                report["loss"][key] = compare_curves(ca[key], cb[key])
        if ca["loss"] and cb["loss"] and not report["loss"]:
            raise UserError(f"compare: A's and B's loss curves share no step (A: {min(ca['loss'])}-"
                            f"{max(ca['loss'])}, B: {min(cb['loss'])}-{max(cb['loss'])}; train with the "
                            "same --log-every, or compare their checkpoints alone)")
    if a.checkpoint and b.checkpoint:
        report["tensors"] = compare_tensors(a, b, args.optim)
    return report


def verdict(report: dict, limit: float | None) -> list[str]:
    """What is above --fail-above: one phrase each (none: pass)."""
    if limit is None:
        return []
    out = []
    worst = next((r for r in report.get("tensors", {}).get("tensors", []) if r["name"].startswith("model/")),
                 None)
    if worst and worst["max_rel"] > limit:
        out.append(f"{worst['name']} differs by {worst['max_rel']:.3g} (relative)")
    if report.get("kl") and report["kl"]["mean_kl"] > limit:
        out.append(f"mean KL(A||B) {report['kl']['mean_kl']:.3g} nats/token")
    return out


def text(report: dict, top: int) -> str:
    lines = [f"A: {report['a']}", f"B: {report['b']}"]
    for key, c in report["loss"].items():
        lines.append(f"{key}: {c['steps']} steps in common ({c['first']}-{c['last']}); largest difference "
                     f"{c['max_abs']:.3g} at step {c['max_abs_step']}, relative {c['max_rel']:.3g} at step "
                     f"{c['max_rel_step']}")
        if key == "loss":
            every = f" (every {c['every']} steps, the last and the worst)" if c["every"] > 1 else ""
            lines.append(f"  {'step':>8} {'loss A':>14} {'loss B':>14} {'B - A':>11}{every}")
            lines += [f"  {r['step']:>8} {r['a']:>14.9f} {r['b']:>14.9f} {r['diff']:>11.3e}" for r in c["rows"]]
    t = report.get("tensors")
    if t:
        worst = t["tensors"][0]["max_rel"] if t["tensors"] else 0.0
        lines.append(f"tensors (step {t['step_a']} vs {t['step_b']}): {t['compared']} compared by name, largest "
                     f"relative difference {worst:.3g}; max |A - B| relative to the tensor's largest magnitude")
        lines.append(f"  {'tensor':<36} {'max |A - B|':>12} {'relative':>10}")
        for r in t["tensors"][:top]:
            shapes = f"  shapes {r['shape_a']} vs {r['shape_b']}" if "shape_a" in r else ""
            lines.append(f"  {r['name']:<36} {r['max_abs']:>12.3e} {r['max_rel']:>10.3e}{shapes}")
        for side in ("a", "b"):
            if t[f"only_{side}"]:
                names = t[f"only_{side}"]
                lines.append(f"  only in {side.upper()}: {', '.join(names[:5])}"
                             f"{f' and {len(names) - 5} more' if len(names) > 5 else ''}")
    kl = report.get("kl")
    if kl:
        lines.append(f"next-token distributions on {kl['windows']} windows, {kl['tokens']:,} positions of "
                     f"{kl['data']}: KL(A||B) mean {kl['mean_kl']:.3e}, max {kl['max_kl']:.3e} nats/token; "
                     f"top-1 agreement {100 * kl['top1_agreement']:.2f}%")
    if not (report["loss"] or t or kl):
        lines.append("nothing to compare: neither loss curves in both nor checkpoints in both")
    return "\n".join(lines)


def plot(report: dict, path: str, command: str) -> None:
    """Both loss curves and their difference, stamped with the machine and the command."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = report["loss"].get("loss")
    if c is None:
        raise UserError("compare --plot: A and B have no loss curves in common to draw")
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    for side, name in (("a", report["a"]), ("b", report["b"])):
        ax.plot(*zip(*c[side]), lw=1, label=f"{side.upper()}: {name}")
    a, b = dict(map(tuple, c["a"])), dict(map(tuple, c["b"]))
    steps = sorted(set(a) & set(b))
    dx.plot(steps, [b[s] - a[s] for s in steps], lw=1, color="k")
    ax.set_ylabel("training loss (nats/token)")
    ax.legend(fontsize=7)
    dx.set_ylabel("B - A")
    dx.set_xlabel("step")
    fig.text(0.01, 0.005, f"{machine_text()}; {command}", fontsize=6)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("compare --plot needs matplotlib: pip install matplotlib (or drop --plot)") from None


def cmd_compare(args, comm) -> int:
    from mpi_tp.inference.divergence import divergence
    rank0 = comm.Get_rank() == 0
    if args.plot:
        collective_setup(_require_matplotlib, comm=comm)
    a, b = collective_setup(lambda: (find(args.a, args.step_a, "A"), find(args.b, args.step_b, "B")), comm=comm)
    config = collective_setup(same_model, a, b, comm=comm)          # every rank: a few bytes of metadata
    kl_runs = a.checkpoint and b.checkpoint and args.windows
    if kl_runs:                                                      # bad --data said before the long parts
        tokens, what = collective_setup(validation_tokens, a, args.data, comm=comm)
    report = collective_setup(lambda: compare_files(a, b, config, args) if rank0 else None, comm=comm)
    if kl_runs:
        kl = divergence(a.checkpoint, b.checkpoint, tokens, comm, args.windows)
        if rank0:
            report["kl"] = {**kl, "data": what}

    def say() -> int:                   # rank 0: the report, its verdict and its plot
        command = "mpi-tp compare " + " ".join(sys.argv[sys.argv.index("compare") + 1:] if "compare" in sys.argv
                                                else [args.a, args.b])
        report["machine"], report["command"] = machine_text(), command
        failed = verdict(report, args.fail_above)
        report["failed"] = failed
        print(json.dumps(finite(report), allow_nan=False) if args.json else text(report, args.top), flush=True)
        if failed and not args.json:
            print(f"compare: above --fail-above {args.fail_above:g}: {'; '.join(failed)}", file=sys.stderr,
                  flush=True)
        if args.plot:
            plot(report, args.plot, command)
        return 1 if failed else 0
    return on_rank0(say, comm)


def _nonnegative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"must be at least 0, got {n}")
    return n


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="two runs or checkpoints side by side: loss curves, tensors by name, "
                       "next-token KL", description=__doc__.split("\n\n")[0])
    c.add_argument("a", metavar="A", help="a run folder (train --out), a checkpoint folder, a step-N folder or a "
                   "Hugging Face folder")
    c.add_argument("b", metavar="B", help="the same kinds as A")
    c.add_argument("--step-a", type=int, help="A's checkpoint at this step (default: its latest)")
    c.add_argument("--step-b", type=int, help="B's checkpoint at this step (default: its latest)")
    c.add_argument("--top", type=_nonnegative, default=10, help="tensors shown, worst first (default 10)")
    c.add_argument("--optim", action="store_true", help="compare the optimizer state (optim/...) too")
    c.add_argument("--windows", type=_nonnegative, default=8, help="windows of block_size tokens the next-token "
                   "KL runs on (default 8; 0: skip it)")
    c.add_argument("--data", help="text (or token file) for the KL (default: A's training data, validation part)")
    c.add_argument("--plot", metavar="FILE.png", help="draw both loss curves and their difference (matplotlib)")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    c.add_argument("--fail-above", type=float, metavar="X", help="exit 1 when the largest relative tensor "
                   "difference or the mean KL is above X")
    c.set_defaults(run=cmd_compare)
