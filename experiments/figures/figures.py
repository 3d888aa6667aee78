"""The figures of docs/learn.md, drawn from the project's own layers and counters.

    mpiexec -n 3 python -m mpi4py experiments/figures/figures.py                  # writes docs/figures/*.png
    mpiexec -n 3 python -m mpi4py experiments/figures/figures.py --out /tmp/figs  # somewhere else

Needs matplotlib, which mpi_tp itself does not depend on: `pip install matplotlib`.
It runs on exactly 3 ranks. Nothing in a picture is typed in by hand when the
code can say it: the cuts (which columns, rows, heads, vocabulary entries and
positions each rank holds) are read from real ColumnParallelLinear,
RowParallelLinear, Block and VocabParallelEmbedding objects built on the 3-rank
group, and every collective named in a caption is counted by `CommStats` while
those layers run a forward and a backward pass. The last figure is one
forward and one backward pass of a small GPT on a group of 2 of the 3 ranks
(T = 2), with and without sequence parallelism; the two ranks must count the
same collectives, and the figure shows rank 0's. Rank 0 gathers the facts,
draws, and prints the files it wrote.
"""
import argparse
import os

from mpi4py import MPI

try:
    import matplotlib  # noqa: F401
except ImportError:
    raise SystemExit("experiments/figures/figures.py needs matplotlib: pip install matplotlib") from None

from figure_counters import fig_step
from figure_drawing import (COMM, RANK_COLOR, WHOLE, Rectangle, arrow, box, by_rank, grid, new_axes, said, save,
                            span)
from figure_facts import block_facts, linear_facts, step_counters, vocab_facts

from mpi_tp.parallel.collectives import Group

RANKS = 3
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- the figures

def fig_column(f, out, written):
    cuts = [(w[1], w[2]) for w in (r["col_w"] for r in f)]
    owner = by_rank(cuts)
    fig, ax = new_axes(11, 4.9, (-0.5, 27), (-5.0, 7.0))
    box(ax, 0.9, 2, 1.6, 1.2, "f", face=COMM, size=14, weight="bold", color="white")
    ax.text(0.9, 0.9, "forward: identity\nbackward:\nall-reduce dX", ha="center", va="top", fontsize=8)
    arrow(ax, 1.8, 2, 2.6, 2)
    grid(ax, 2.8, 4, 4, 6, lambda r, c: WHOLE)
    ax.text(5.8, 4.4, "X  (4 tokens × 6)\nwhole on every rank", ha="center", va="bottom", fontsize=9)
    ax.text(9.5, 2, "×", ha="center", va="center", fontsize=18)
    grid(ax, 10.5, 5, 6, 7, lambda r, c: RANK_COLOR[owner(c)])
    for r, (a, b) in enumerate(cuts):
        ax.text(10.5 + (a + b) / 2, 5.3, f"rank {r}\ncols {span(a, b)}", ha="center", va="bottom",
                fontsize=8.5, color=RANK_COLOR[r], weight="bold")
    ax.text(14.0, -1.4, "A  (6 × 7), stored (in, out)", ha="center", va="top", fontsize=9)
    ax.text(18.4, 2, "=", ha="center", va="center", fontsize=18)
    grid(ax, 19.5, 4, 4, 7, lambda r, c: RANK_COLOR[owner(c)])
    for r, (a, b) in enumerate(cuts):
        ax.text(19.5 + (a + b) / 2, 4.3, f"$Y_{r}$", ha="center", va="bottom", fontsize=11, color=RANK_COLOR[r])
    ax.text(23.0, -0.4, "Y: each rank holds only\nits own columns", ha="center", va="top", fontsize=9)
    lines = [f"rank {r} holds $A_{r}$ = A[:, {a}:{b}] {tuple(s['col_w'][3])} and b[{a}:{b}]; "
             f"computes $Y_{r} = X\\,A_{r} + b_{r}$, shape {tuple(s['col_y'])}"
             for r, (s, (a, b)) in enumerate(zip(f, cuts))]
    for r, line in enumerate(lines):
        ax.text(0, -2.6 - 0.9 * r, line, fontsize=9.5, color=RANK_COLOR[r], va="center")
    ax.set_title(f"Column split: ColumnParallelLinear(in=6, out=7) on 3 ranks.  Counted: forward "
                 f"{said(f[0]['col_fwd'])}; backward {said(f[0]['col_bwd'])} (f)", fontsize=10)
    save(fig, out, "column_split.png", written, ax=ax)


def fig_row(f, out, written):
    cuts = [(w[1], w[2]) for w in (r["row_w"] for r in f)]
    owner = by_rank(cuts)
    fig, ax = new_axes(11, 5.0, (-0.5, 35), (-7.6, 6.6))
    grid(ax, 0, 3.5, 4, 7, lambda r, c: RANK_COLOR[owner(c)])
    for r, (a, b) in enumerate(cuts):
        ax.text((a + b) / 2, 3.8, f"$X_{r}$", ha="center", va="bottom", fontsize=11, color=RANK_COLOR[r])
    ax.text(3.5, -0.9, "X (4 × 7) cut by columns:\n$X_i$ is the column layer's $Y_i$", ha="center",
            va="top", fontsize=9)
    ax.text(8.0, 1.5, "×", ha="center", va="center", fontsize=18)
    grid(ax, 9, 5, 7, 6, lambda r, c: RANK_COLOR[owner(r)], cell=0.9)
    for r, (a, b) in enumerate(cuts):
        ax.text(14.6, 5 - 0.9 * (a + b) / 2, f"rank {r}: rows {span(a, b)}", ha="left", va="center",
                fontsize=8.5, color=RANK_COLOR[r], weight="bold")
    ax.text(11.7, -1.6, "A (7 × 6) cut by rows", ha="center", va="top", fontsize=9)
    for r in range(RANKS):                                     # the partial products, one per rank
        top = 5.6 - 3.6 * r
        grid(ax, 20.5, top, 4, 6, lambda i, j, r=r: RANK_COLOR[r], cell=0.6)
        ax.text(20.2, top - 1.2, f"$X_{r} A_{r}$", ha="right", va="center", fontsize=10, color=RANK_COLOR[r])
        arrow(ax, 24.3, top - (2.0 if r == 0 else 1.2), 25.75, 1.5 - 0.4 * (r - 1))   # clear of g's caption
    ax.text(22.3, -4.4, f"partial sums, each {tuple(f[0]['row_z'])}: not yet the output",
            ha="center", va="top", fontsize=9)
    box(ax, 26.8, 1.5, 2.0, 1.6, "g", face=COMM, size=14, weight="bold", color="white")
    ax.text(27.6, 2.55, "forward: all-reduce\n(sum over ranks)\nbackward: identity", ha="center",
            va="bottom", fontsize=8)                        # above g: the arrows from below do not cross it
    arrow(ax, 27.9, 1.5, 30.0, 1.5)
    grid(ax, 30.2, 2.7, 4, 6, lambda i, j: WHOLE, cell=0.6)
    ax.text(32.0, 3.0, "+ b  (once)", ha="center", va="bottom", fontsize=10)
    ax.text(32.0, -0.1, "Y = $\\sum_i X_i A_i$ + b\nwhole on every rank", ha="center", va="top", fontsize=9)
    ax.text(0, -5.9, "The bias is replicated (axis None) and added after g: added before, it would be counted "
            "3 times.", fontsize=9.5)
    ax.text(0, -6.9, f"Counted: forward {said(f[0]['row_fwd'])} (g); backward {said(f[0]['row_bwd'])}.",
            fontsize=9.5)
    ax.set_title("Row split: RowParallelLinear(in=7, out=6, sizes = the column layer's) on 3 ranks", fontsize=10)
    save(fig, out, "row_split.png", written, ax=ax)


def fig_block(f, out, written, sp: bool):
    """The transformer block under tensor parallelism (sp=False) or with sequence parallelism (sp=True)."""
    fig, ax = new_axes(12, 6.9, (-0.8, 31), (-11.6, 5.9))
    lanes = [1.25, 0.0, -1.25]                                # rank 0, 1, 2
    enter = ("all-gather\n(sequence)", "bwd: reduce-scatter") if sp else ("f", "fwd: identity\nbwd: all-reduce")
    leave = ("reduce-\nscatter\n(sequence)", "bwd: all-gather") if sp else ("g", "fwd: all-reduce\nbwd: identity")
    hs = f[0]["head_size"]
    rows = [("attention", 2.2, "ln_1",
             [lambda s: f"q,k,v\ncolumns\nheads {span(*s['heads'])}",
              lambda s: f"attention\nheads {span(*s['heads'])}",
              lambda s: f"proj rows\n{span(*s['qkv_cols'])}"]),
            ("MLP", -5.2, "ln_2",
             [lambda s: f"fc columns\n{span(*s['fc_cols'])}",
              lambda s: "GELU",
              lambda s: f"proj rows\n{span(*s['fc_cols'])}"])]
    for name, y, ln, stages in rows:
        if sp:                                                 # outside the region: each rank its positions
            for r, dy in enumerate(lanes):
                s = f[r]
                box(ax, 1.6, y + dy * 1.15, 3.0, 1.2, f"{ln}, pos. {span(*s['positions'])}",
                    face=RANK_COLOR[r], size=8, color="white")
            ax.text(1.6, y + 2.5, "x: (B, $S_i$, C)", ha="center", fontsize=9)
        else:
            box(ax, 1.6, y, 2.4, 1.2, ln, face=WHOLE)
            ax.text(1.6, y + 1.0, "x: (B, S, C), whole", ha="center", fontsize=9)
        for dy in (lanes if sp else [0.0]):
            arrow(ax, 3.15, y + dy * 1.15, 4.25, y)
        box(ax, 5.6, y, 2.6 if sp else 1.4, 2.2 if sp else 1.4, enter[0], face=COMM, size=8.5 if sp else 14,
            weight="bold", color="white")
        ax.text(5.6, y - 1.6 if sp else y - 1.1, enter[1], ha="center", va="top", fontsize=8)
        for r, dy in enumerate(lanes):                         # the tensor-parallel region: one lane per rank
            s = f[r]
            arrow(ax, 6.9, y, 8.0, y + dy * 1.5)
            for k, stage in enumerate(stages):
                x = 9.6 + 3.8 * k
                box(ax, x, y + dy * 1.5, 3.0, 1.6, stage(s), face=RANK_COLOR[r], size=8, color="white")
                if k:
                    arrow(ax, x - 2.3, y + dy * 1.5, x - 1.5, y + dy * 1.5)
            arrow(ax, 18.8, y + dy * 1.5, 20.3, y)
        ax.add_patch(Rectangle((7.7, y - 3.0), 12.8, 6.0, fill=False, edgecolor="#777777", linestyle="--"))
        ax.text(14.1, y + 3.1, f"{name}: tensor-parallel region (one lane per rank)", ha="center",
                va="bottom", fontsize=9, color="#555555")
        box(ax, 21.8, y, 2.6 if sp else 1.4, 2.4 if sp else 1.4, leave[0], face=COMM, size=8.5 if sp else 14,
            weight="bold", color="white")
        ax.text(21.8, y - 1.6 if sp else y - 1.1, leave[1], ha="center", va="top", fontsize=8)
        for dy in (lanes if sp else [0.0]):
            arrow(ax, 23.15, y, 24.65, y + dy * 1.15)
        if sp:
            for r, dy in enumerate(lanes):
                box(ax, 26.3, y + dy * 1.15, 3.2, 1.0, f"+ x, pos. {span(*f[r]['positions'])}",
                    face=RANK_COLOR[r], size=8, color="white")
            ax.text(26.3, y + 2.0, "residual", ha="center", fontsize=8)
        else:
            box(ax, 25.6, y, 1.6, 1.2, "+ x", face=WHOLE)
            ax.text(25.6, y + 0.9, "residual", ha="center", fontsize=8)
        ax.text(28.1 if sp else 26.7, y, "(B, $S_i$, C)" if sp else "(B, S, C)", va="center", fontsize=9)
    if sp:
        note = ["Entering a region all-gathers the positions, leaving it reduce-scatters them: per block 2 + 2 each way,",
                ("the same bytes on the wire as 4 all-reduces; LayerNorms, dropout and residuals "
                 "work on 1/T of the positions."),
                ("q/k/v and fc keep only their input's positions and gather them again for dA (regather): "
                 "every activation kept is 1/T."),
                f"Counted on one Block, T = 3, S = 8: forward {said(f[0]['fwd'])}; backward {said(f[0]['bwd'])}.",
                ("finalize_grads adds one packed all-reduce per gradient bucket and step of the replicated "
                 "parameters' gradients (sp_grad_all_reduce).")]
        title = "Sequence parallelism: the same block, activations split by position outside the regions"
    else:
        note = ["Per block: 2 all-reduces forward (the two g) and 2 backward (the two f), B·S·C values each.",
                f"Counted on one Block, T = 3: forward {said(f[0]['fwd'])}; backward {said(f[0]['bwd'])}.",
                f"5 heads of size hs = {hs} over 3 ranks (uneven); q/k/v is one fused ColumnParallelLinear behind one f."]
    for i, line in enumerate(note):
        ax.text(-0.6, -9.4 - 0.75 * i, line, fontsize=9.5, va="center")
    ax.set_ylim(-9.4 - 0.75 * len(note), 5.9)               # room for every note line above the stamp
    ax.set_title(title if sp else "A transformer block under tensor parallelism (T = 3, C = 20, 5 heads, "
                 "MLP width 80)", fontsize=10.5)
    save(fig, out, "block_sp.png" if sp else "block_tp.png", written, ax=ax)


def fig_vocab(f, out, written):
    cuts = [r["rows"] for r in f]
    owner = by_rank(cuts)
    ids = f[0]["ids"]
    fig, ax = new_axes(12, 6.4, (-0.6, 33.5), (-12.2, 6.2))
    # 1. the table and the lookup
    grid(ax, 0, 5, 10, 4, lambda r, c: RANK_COLOR[owner(r)], cell=0.8)
    for r, (a, b) in enumerate(cuts):
        ax.text(3.4, 5 - 0.8 * (a + b) / 2, f"rank {r}:\nrows {span(a, b)}", va="center", fontsize=8.5,
                color=RANK_COLOR[r], weight="bold")
    ax.text(1.6, -3.3, "wte (V=10 × C=4)\ncut by rows", ha="center", va="top", fontsize=9)
    ax.text(7.4, 5.4, "token ids", ha="left", fontsize=9)
    grid(ax, 7.4, 5.2, 1, 5, lambda r, c: RANK_COLOR[owner(ids[c])], cell=0.8, text=lambda r, c: str(ids[c]))
    for r in range(RANKS):
        top = 3.2 - 2.6 * r
        mine = lambda i, j, r=r: RANK_COLOR[r] if owner(ids[i]) == r else "#F2F2F2"
        grid(ax, 7.6, top, 5, 4, lambda i, j, m=mine: m(i, j), cell=0.45)
        ax.text(7.3, top - 1.1, f"rank {r}", ha="right", va="center", fontsize=8.5, color=RANK_COLOR[r])
        arrow(ax, 9.6, top - 1.1, 10.7, -1.4)
    ax.text(8.5, -5.2, "own tokens looked up,\nzeros elsewhere", ha="center", va="top", fontsize=8.5)
    box(ax, 11.6, -1.4, 1.6, 1.4, "g", face=COMM, size=14, weight="bold", color="white")
    ax.text(11.6, -2.4, "all-reduce\nB·S·C values", ha="center", va="top", fontsize=8)
    # 2. the blocks and the tied head
    arrow(ax, 12.5, -1.4, 13.6, -1.4)
    box(ax, 14.9, -1.4, 2.4, 1.6, "blocks,\nln_f", face=WHOLE)
    arrow(ax, 16.2, -1.4, 17.0, -1.4)
    box(ax, 17.8, -1.4, 1.4, 1.4, "f", face=COMM, size=14, weight="bold", color="white")
    for r, (a, b) in enumerate(cuts):
        top = 3.6 - 3.2 * r
        grid(ax, 19.6, top, 5, b - a, lambda i, j, r=r: RANK_COLOR[r], cell=0.45)
        ax.text(19.6 + 0.45 * (b - a) + 0.2, top - 1.1, f"rank {r}: logits\ncolumns {span(a, b)}",
                va="center", fontsize=8.5, color=RANK_COLOR[r])
        arrow(ax, 18.5, -1.4, 19.5, top - 1.1)
    ax.text(21.2, -6.6, "tied head: logits_i = x $wte_i^T$\n(B·S × $V_i$), never gathered", ha="center",
            va="top", fontsize=9)
    # 3. the loss: two small all-reduces instead of gathering B·S·V logits
    calls = f[0]["loss_fwd"].get("all_reduce", (0, 0, 0))
    steps = [("local max of each row j: m$_j$", "white"), ("all-reduce MAX\n(B·S values)", COMM),
             ("local Σ$_v$ exp(l$_{jv}$ − m$_j$)\n+ target logit l$_{j,y_j}$ (its owner)", "white"),
             ("all-reduce SUM\n(2·B·S values)", COMM),
             ("loss$_j$ = log Σ$_v$ exp(l$_{jv}$ − m$_j$)\n− (l$_{j,y_j}$ − m$_j$)", WHOLE)]
    for k, (label, face) in enumerate(steps):
        y = 4.4 - 2.1 * k
        box(ax, 29.6, y, 6.4, 1.5, label, face=face, size=8.5, color="white" if face == COMM else "black")
        if k:
            arrow(ax, 29.6, y + 1.35, 29.6, y + 0.75)
    ax.text(29.6, -6.2, "backward: (softmax − onehot)/N\non each rank's columns, no communication\n"
            "(l logits, m row maxima, y targets, j a row)", ha="center", va="top", fontsize=8.5)
    n = len(ids)
    lines = [(f"Counted (T = 3, {n} tokens, float64): embedding forward {said(f[0]['emb_fwd'])} "
              f"({f[0]['emb_fwd']['all_reduce'][1]} bytes); loss forward {calls[0]} all-reduces, "
              f"{calls[1]} bytes together (= 3·{n} values);"),
             (f"backward: loss {said(f[0]['loss_bwd'])}, tied head {said(f[0]['head_bwd'])} (f), "
              f"embedding {said(f[0]['emb_bwd'])}.")]
    for i, line in enumerate(lines):
        ax.text(-0.4, -9.8 - 0.8 * i, line, fontsize=9.5, va="center")
    ax.set_title("Vocabulary split: VocabParallelEmbedding, the tied output layer and VocabParallelCrossEntropy",
                 fontsize=10.5)
    save(fig, out, "vocab_parallel.png", written, ax=ax)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "docs", "figures"), help="folder for the PNGs")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    if world.Get_size() != RANKS:
        if world.Get_rank() == 0:
            print(f"figures.py needs exactly {RANKS} ranks (it has {world.Get_size()}): "
                  f"mpiexec -n {RANKS} python -m mpi4py experiments/figures/figures.py")
        raise SystemExit(2)
    tp = Group(world, "tp")
    facts = {"linear": linear_facts(tp), "block": block_facts(world, False), "block_sp": block_facts(world, True),
             "vocab": vocab_facts(tp)}
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    step = None
    if pair != MPI.COMM_NULL:
        step = (step_counters(pair, False), step_counters(pair, True))
        both = pair.gather(step, root=0)
        if pair.Get_rank() == 0 and both[0] != both[1]:   # the figure says the two ranks count the same
            raise SystemExit(f"ranks 0 and 1 counted different collectives: {both}")
        pair.Free()
    everyone = world.gather(facts, root=0)
    if world.Get_rank() != 0:
        return
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)
    written = []
    per = {k: [r[k] for r in everyone] for k in facts}
    fig_column(per["linear"], out, written)
    fig_row(per["linear"], out, written)
    fig_block(per["block"], out, written, sp=False)
    fig_block(per["block_sp"], out, written, sp=True)
    fig_vocab(per["vocab"], out, written)
    fig_step(*step, out, written)
    for layout, counts in zip(("TP", "TP+SP"), step):
        for d in ("fwd", "bwd"):
            print(f"T = 2 {layout:5} {d}: " + ", ".join(f"{k} {c[0]} calls {c[1]:,} bytes ({c[2]:,} on the wire)"
                                                       for k, c in counts[d].items()))
    for path in written:
        print(f"wrote {path} ({os.path.getsize(path) / 1000:.0f} kB)")


if __name__ == "__main__":
    main()
