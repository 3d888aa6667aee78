"""The figure of moe_dispatch.py's dispatcher comparison (docs/figures/moe_dispatchers.png), from its raw lines.

    python experiments/moe/moe_dispatch.py --plot       # draws it with the others

Top row: wire bytes a rank sends per token of the global batch, per (E, k): the all-to-all dispatcher, the
all-gather dispatcher and the dense MLP's all-reduce, with their formulas as black ticks (4 k (T-1)/T^2 C 4,
4 k (T-1)/T C 4, 4 (T-1)/T C 4). Bottom row: the median step (forward + backward, slowest rank) of each
dispatcher's MoE MLP, its collectives' share hatched, and the dense MLP's step timed in the same call.
"""
import numpy


def dispatchers(plt, rows, C, S, B):
    """rows: moe_dispatch.py's "bytes" lines of both dispatchers; None when no point has both."""
    pairs = {}
    for r in rows:
        pairs.setdefault((r["ranks"], r["experts"], r["top_k"]), {})[r["moe"].get("dispatcher", "alltoall")] = r
    pairs = {key: p for key, p in pairs.items() if len(p) == 2}
    Ts = sorted({T for T, _, _ in pairs})
    if not Ts:
        return None
    fig, axes = plt.subplots(2, len(Ts), figsize=(max(9.0, 6.0 * len(Ts)), 7.6), dpi=110, squeeze=False)
    colors = {"alltoall": "C1", "allgather": "C2", "dense": "C0"}
    for col, T in enumerate(Ts):
        keys = sorted(key for key in pairs if key[0] == T)
        pos = numpy.arange(len(keys))
        top, bottom = axes[0][col], axes[1][col]
        formula = {"alltoall": lambda k: 4 * k * (T - 1) / T ** 2 * C * 4,
                   "allgather": lambda k: 4 * k * (T - 1) / T * C * 4, "dense": lambda k: 4 * (T - 1) / T * C * 4}
        for i, (name, label) in enumerate((("alltoall", "MoE, all-to-all"), ("allgather", "MoE, all-gather"),
                                           ("dense", "dense k 4C, all-reduce"))):
            x = pos + (i - 1) * 0.27
            vals = [pairs[key]["alltoall"]["dense" if name == "dense" else "moe"]["bytes_per_token"]
                    if name in ("dense", "alltoall") else pairs[key]["allgather"]["moe"]["bytes_per_token"]
                    for key in keys]
            top.bar(x, vals, 0.27, color=colors[name], label=label + " (measured)")
            top.plot(x, [formula[name](key[2]) for key in keys], "k_", ms=12, mew=1.5,
                     label="formulas" if i == 0 else None)
            for xi, v in zip(x, vals):
                top.text(xi, v * 1.02, f"{v:.0f}", ha="center", va="bottom", fontsize=6)
            if name == "dense":
                ms = [pairs[key]["alltoall"]["dense"]["step_ms"]["median"] for key in keys]
                bottom.bar(x, ms, 0.27, color=colors[name], label="dense step (the all-to-all's call)")
                continue
            moe = [pairs[key][name]["moe"] for key in keys]
            bottom.bar(x, [m["step_ms"]["median"] for m in moe], 0.27, color=colors[name], label=f"{label} step")
            bottom.bar(x, [m["dispatch_ms"] for m in moe], 0.27, color="none", edgecolor="k", hatch="///", lw=0.5,
                       label="its collectives" if i == 0 else None)
        loads = [pairs[key][d]["loadavg_start"] for key in keys for d in ("alltoall", "allgather")]
        crowded = " (oversubscribed)" if any("oversubscribed" in pairs[key]["alltoall"] for key in keys) else ""
        ticks = [f"E={E}\nk={k}" for _, E, k in keys]
        top.set_xticks(pos, ticks)
        bottom.set_xticks(pos, ticks)
        top.set_ylim(0, 1.2 * top.get_ylim()[1])
        top.set(ylabel="wire bytes sent per rank per token", title=f"ep = T = {T}{crowded}")
        bottom.set(ylabel="ms per step (median, slowest rank)",
                   title=f"T = {T}: step time; load {min(loads):.1f}-{max(loads):.1f}{crowded}")
        for a in (top, bottom):
            a.title.set_fontsize(9)
            a.legend(fontsize=6.5, loc="upper left")
    fig.suptitle(f"MoE dispatchers: all-to-all vs all-gather (ep = dp = T), beside the dense MLP of the same active "
                 f"FLOPs (tp = T)\nC {C}, S {S}, B {B} sequences per replica, float32, dropless; untrained router "
                 f"on pydoc bytes", fontsize=9)
    return fig
