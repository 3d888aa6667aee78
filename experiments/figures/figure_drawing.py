"""Drawing helpers for the figures of docs/learn.md (experiments/figures/figures.py): matrices, boxes, arrows, PNGs."""
import io
import os

import matplotlib

matplotlib.use("Agg")                          # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402
from PIL import Image  # noqa: E402  (Pillow comes with matplotlib)

RANK_COLOR = ["#4C72B0", "#DD8452", "#55A868"]      # rank 0, 1, 2 (the same in every figure)
WHOLE = "#D9D9D9"                                   # replicated: the same numbers on every rank
COMM = "#C44E52"                                    # boxes that communicate (f, g and friends)


def new_axes(width, height, xlim, ylim):
    fig, ax = plt.subplots(figsize=(width, height))
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def grid(ax, x, y, rows, cols, color, cell=1.0, text=None):
    """A matrix of rows x cols cells, top-left corner at (x, y); color(r, c) and text(r, c) per cell."""
    for r in range(rows):
        for c in range(cols):
            ax.add_patch(Rectangle((x + c * cell, y - (r + 1) * cell), cell, cell,
                                   facecolor=color(r, c), edgecolor="white", linewidth=1.2))
            if text is not None and text(r, c):
                ax.text(x + (c + 0.5) * cell, y - (r + 0.5) * cell, text(r, c),
                        ha="center", va="center", fontsize=8)


def box(ax, x, y, w, h, label, face="white", edge="#333333", size=9, weight="normal", color="black"):
    """A rounded box centred at (x, y)."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.15",
                                facecolor=face, edgecolor=edge, linewidth=1.2))
    ax.text(x, y, label, ha="center", va="center", fontsize=size, weight=weight, color=color)


def arrow(ax, x0, y0, x1, y1, color="#333333"):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                arrowprops=dict(arrowstyle="->", color=color, linewidth=1.2, shrinkA=0, shrinkB=0))


def by_rank(cuts):
    """Rank that owns index i, given each rank's (start, stop)."""
    return lambda i: next(r for r, (a, b) in enumerate(cuts) if a <= i < b)


def span(a, b):
    return f"{a}" if b - a == 1 else f"{a}–{b - 1}"


def said(counts):
    """{kind: (calls, ...)} -> '1 all_reduce' style text; 'no collective' when empty."""
    return ", ".join(f"{c[0]} {k}" for k, c in counts.items()) or "no collective"


STAMP = "drawn by: mpiexec -n 3 python -m mpi4py experiments/figures/figures.py (counts from the layers, any machine)"


def save(fig, out, name, written, ax=None):
    """Write the figure as a 256-colour PNG, stamped with the command that draws it (under the drawing
    `ax` when given, else at the figure's foot): flat drawings lose nothing and the files stay small."""
    if ax is not None:
        ax.text(0, 0, STAMP, transform=ax.transAxes, ha="left", va="top", fontsize=6, color="#777777")
    else:
        fig.text(0.005, 0.003, STAMP, ha="left", va="bottom", fontsize=6, color="#777777")
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    buf.seek(0)
    path = os.path.join(out, name)
    Image.open(buf).convert("RGB").quantize(colors=256).save(path, optimize=True)
    written.append(path)
