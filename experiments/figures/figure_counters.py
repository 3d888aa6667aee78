"""The last figure of docs/learn.md: the collectives of one training step, counted (step_counters.png).

Drawn by experiments/figures/figures.py from the counters of a small GPT's forward and
backward pass at T = 2 (figure_facts.step_counters; figures.py checks that both
ranks of the group count the same), with and without sequence parallelism:
calls, buffer bytes and wire bytes per kind of collective.
"""
import numpy as np
from figure_drawing import plt, save
from figure_facts import STEP, STEP_B


def fig_step(tp, sp, out, written):
    labels, rows = [], []
    for layout, c in (("TP", tp), ("TP+SP", sp)):
        for kind in sorted(set(c["fwd"]) | set(c["bwd"])):
            labels.append(f"{layout}\n" + kind.replace("sp_grad_", "sp_grad_\n").replace("_scatter", "_\nscatter"))
            rows.append([c[d].get(kind, (0, 0, 0)) for d in ("fwd", "bwd")])
    rows = np.array(rows, dtype=float)                         # (kinds, fwd/bwd, calls/bytes/wire)
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2))
    x = np.arange(len(labels))
    panels = ("calls", "buffer bytes (KiB)", "wire bytes: sent per rank by a ring (KiB)")
    for j, (ax, what) in enumerate(zip(axes, panels)):
        scale = 1 if j == 0 else 1024
        for d, (name, color) in enumerate((("forward", "#4C72B0"), ("backward", "#C44E52"))):
            vals = rows[:, d, j] / scale
            bars = ax.bar(x + (d - 0.5) * 0.4, vals, 0.4, label=name, color=color)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v else "" for v in vals], fontsize=7.5, padding=1)
        ax.set_xticks(x, labels, fontsize=7.5)
        ax.set_title(what, fontsize=9.5)
        ax.set_ylim(0, rows[:, :, j].max() / scale * 1.3)
        ax.spines[["top", "right"]].set_visible(False)
    axes[0].legend(frameon=False, fontsize=9, ncol=2, loc="upper right")
    L, C, S = STEP["n_layer"], STEP["n_embd"], STEP["block_size"]
    fig.suptitle(f"One forward and one backward pass at T = 2, counted by CommStats on a tensor-parallel group of "
                 f"2 ranks (each counts the same)\nGPT(n_layer={L}, n_embd={C}, n_head={STEP['n_head']}), B={STEP_B}, "
                 f"S={S}, float32", fontsize=10.5)
    fig.tight_layout()
    save(fig, out, "step_counters.png", written)
