"""The table `mpi-tp plan` prints: one row per layout, every column explained by LEGEND.

Units follow the numbers: seconds, or milliseconds when every step is under
0.1 s; GB per rank, or MB under 1 GB; TFLOP/s, GFLOP/s or MFLOP/s; parameters
in B or M. docs/costmodel.md quotes the legend word for word (tested).
"""
from __future__ import annotations

import textwrap

from mpi_tp.planning.workload import Workload


# Every column of the table, as `mpi-tp plan --legend` prints it (docs/costmodel.md shows the same text).
LEGEND = (
    ("#", "rank of the layout, fastest first (only layouts that fit in memory)"),
    ("layout", ("tpT ppP dpD bB: T tensor-parallel ranks, P pipeline stages, D replicas, micro-batches of B "
               "sequences; cpZ: Z context-parallel ranks (each sequence split over them, ring attention); epN: a "
               "mixture of experts' experts over N groups of a stage's T Z D ranks; etpN: each expert split over N "
               "ranks (shown when not T; a stage's T Z D ranks laid out as etp x ep x edp); vN: N chunks per stage (the interleaved schedule); "
               "zb-h1, zb-v: the zero-bubble schedules (zb-v: two chunks per rank in a V); +sp sequence parallelism; "
               "+zeroN ZeRO stage N (1: optimizer state, 2: and gradients, 3: and parameters sharded over D); "
               "+recompute full activation recomputation; +tp-overlap tensor-parallel collectives overlapped with "
               "the GEMMs (--overlap-tp); endsF/L: the first and last stage's blocks, the short stages at the ends")),
    ("step s", "predicted seconds per training step (step ms: milliseconds, when every row is under 0.1 s; "
               "the next eight columns in the same unit): the sum of the next eight columns"),
    ("compute", ("the M micro-batches' GEMMs (at the GEMM rate for B S rows), elementwise work and per-layer "
                "overhead, on the largest stage and the rank with the most heads")),
    ("tp comm", ("tensor-parallel all-reduces: 4 per layer and micro-batch (6 with recomputation) of B S C "
                "values, ring 2 (T-1) alpha + 2 (T-1)/T n beta (+sp: as all-gathers and reduce-scatters, and "
                "2 more all-gathers of the column layers' inputs; +tp-overlap: a quarter of them); MoE blocks: "
                "etp's all-gather and reduce-scatter of "
                "the rows its experts compute and the output gathered over T, in place of the MLP's 2")),
    ("cp comm", ("context parallelism's ring: 3Z - 2 messages of K and V (or their gradients) per layer and "
                "micro-batch, 2 B (S/Z) C / T values each; the machine's pp_overlap of the K/V messages hidden "
                "behind the attention computed meanwhile")),
    ("ep comm", ("a mixture of experts' dispatch: 4 all-to-alls per MoE block and micro-batch (dispatch and "
                "combine, forward and backward), each sending k a B S C / T (ep-1)/ep values from a rank (a: the "
                "share a capacity admits); the all-gather dispatcher's ring all-gathers and reduce-scatters "
                "ep times those bytes")),
    ("pp comm", ("activations sent between pipeline stages (1/T of B S C each, all-gathered on arrival "
                "without +sp; the machine's pp_overlap of each transfer hidden, but in the fill and drain)")),
    ("bubble", ("pipeline stages idle at the start and end of a step: (P-1)/(v M) of compute + tp comm (1/v: "
                "the largest chunk's share of the largest stage where they differ by a block); zb-h1 "
                "(P-1)(1-2w)/M, zb-v (P-1)(1-3w)/(2M), w the share of the weights' gradients (1/3: (P-1)/(3M), 0)")),
    ("dp comm", ("the gradient all-reduce over the D replicas (float32; an expert shard's over the edp = T Z D / "
                "(etp ep) holding it, on the link they cross), "
                "minus what the last backward pass hides (+zero1: a reduce-scatter of the gradients, hidden "
                "alike, and an all-gather of the parameters after the update; +zero2: a reduce-scatter after "
                "every micro-batch's backward; +zero3: and all-gathers of the parameters before every forward "
                "and backward instead of after the update, hidden a layer ahead)")),
    ("optim", ("AdamW: 28 bytes of memory traffic per parameter of the rank over the memory bandwidth "
              "(+zeroN: its share, / D; an expert shard's / edp)")),
    ("GB/rank", ("memory per rank (MB/rank when every row is under 1 GB): weights, gradients, optimizer state, "
                 "activations, logits, on the pipeline stage that holds the most (the first, or the last with "
                 "the logits; zb-h1, zb-v: and the deferred W's inputs)")),
    ("FLOP/s", ("headed TFLOP/s, GFLOP/s or MFLOP/s, whichever keeps the numbers readable: the model's FLOPs "
               "per step, 72 (D M B) S L C^2 (1 + S/(6C)) + 6 (D M B) S C V for the global batch of D M B "
               "sequences (recomputation not counted; an MoE block's MLP counted k a + n times, its active experts'), "
               "/ step s / the W ranks"
               "; other shapes (--arch llama, --n-kv-head, --intermediate-size) add 6 (D M B) S L (P - 12 C^2), P "
               "a block's GEMM multiply-adds per position")),
    ("of peak", ("that FLOP/s as a fraction of the machine's datasheet peak (a calibrated machine: of its "
                "measured GEMM rate)")),
)


def legend() -> str:
    """The legend of the table, one column a line."""
    width = max(len(name) for name, _ in LEGEND)
    return "\n".join(textwrap.fill(text, 100, initial_indent=f"  {name:<{width}}  ",
                                   subsequent_indent=" " * (width + 4), break_on_hyphens=False)
                     for name, text in LEGEND)


def params_text(n: float) -> str:
    """A parameter count: '1.32B' from 1e9 on, '0.03M' below."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def size_text(n: float) -> str:
    """Bytes of memory: '15.2 GB' from 1 GB on, '312.5 MB' below."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def memory_unit(values) -> tuple[float, str]:
    """(divisor, column name) of the memory column: GB/rank, or MB/rank when every row is under 1 GB."""
    return (1e9, "GB/rank") if max(values, default=0.0) >= 1e9 else (1e6, "MB/rank")


def time_unit(values) -> tuple[float, str]:
    """(seconds per unit, name) of the time columns: "step s", or "step ms" when every step is under 0.1 s
    (a laptop-sized model would otherwise print rows of 0.000)."""
    return (1.0, "step s") if max(values, default=0.0) >= 0.1 else (1e-3, "step ms")


def flops_unit(values) -> tuple[float, str]:
    """(divisor, name) that shows the largest of `values` (FLOP/s) with 1 to 3 digits before the point:
    TFLOP/s on GPUs, GFLOP/s on a CPU, MFLOP/s below that."""
    top = max(values, default=0.0)
    for scale, name in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if top >= scale:
            return scale, name
    return 1e6, "MFLOP/s"


def moe_text(w, dispatcher: str | None = None) -> str:
    """The model's experts in words for the table's header: ', experts E=8 top-2 +1 shared every block, ...'."""
    if not w.experts:
        return ""
    every = "every block" if w.moe_every == 1 else f"every {w.moe_every}th block"
    shared = f" +{w.shared_experts} shared" if w.shared_experts else ""
    capacity = f", capacity {w.capacity:g}" if w.capacity else ", dropless"
    return (f"; experts E={w.experts} top-{w.top_k}{shared} in {every} ({w.moe_layers} of {w.n_layer})"
            f"{capacity}" + (f", {dispatcher} dispatcher" if dispatcher else ""))


def table(m, w: Workload, nodes: int, result: dict) -> str:
    """The header line and the ranked layouts, one row each (columns: LEGEND)."""
    scale, unit = flops_unit([r["achieved"]["flops_per_rank"] for r in result["ranked"]])
    mem_scale, mem_unit = memory_unit([r["memory"]["total"] for r in result["ranked"]])
    sec, step = time_unit([r["time"]["total"] for r in result["ranked"]])
    header = (f"{m.name}: {nodes} node(s) x {m.ranks_per_node} = {result['ranks']} ranks; model "
              f"{params_text(w.params)} parameters ({w.shape_text()}, S={w.seq}, "
              f"V={w.vocab}), global batch {w.global_batch} sequences"
              + moe_text(w, result["ranked"][0]["layout"].dispatcher if result["ranked"] else None))
    wide = max([28] + [len(r["layout"].describe()) for r in result["ranked"]])
    columns = (f"{'#':>3} {'layout':<{wide}} {step:>8} {'compute':>8} {'tp comm':>8} {'cp comm':>8} {'ep comm':>8} {'pp comm':>8} {'bubble':>8} "
               f"{'dp comm':>8} {'optim':>7} {mem_unit:>8} {unit:>8} {'of peak':>7}")
    lines = [header, columns]
    for i, r in enumerate(result["ranked"], 1):
        t, mem, a = r["time"], r["memory"], r["achieved"]
        u = {k: v / sec for k, v in t.items() if isinstance(v, (int, float))}
        lines.append(f"{i:>3} {r['layout'].describe():<{wide}} {u['total']:>8.3f} {u['compute']:>8.3f} "
                     f"{u['tp_comm']:>8.3f} {u['cp_comm']:>8.3f} {u['ep_comm']:>8.3f} {u['pp_comm']:>8.3f} {u['bubble']:>8.3f} {u['dp_comm']:>8.3f} "
                     f"{u['optimizer']:>7.3f} {mem['total'] / mem_scale:>8.1f} {a['flops_per_rank'] / scale:>8.1f} "
                     f"{100 * a['fraction_of_peak']:>6.0f}%")
    return "\n".join(lines)
