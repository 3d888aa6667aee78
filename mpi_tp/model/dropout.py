"""Dropout whose masks are the same at every parallel layout, each rank drawing only its own part.

Every element of a mask has a global name, (seed, step, layer, site, [global head,] global row,
its index elem in its sequence's stream), and its bit is a function of that name alone: a Philox
counter (mpi_tp.core.philox) built from it. A rank therefore draws exactly its slice (its heads,
its replica's rows, under sequence parallelism its S_i positions) and still gets the bits that
the serial model draws for the same elements, at any T, D, P, micro-batch count, with or
without sequence parallelism, and again when activation recomputation replays a forward.

    key   seed                                   (128 bits)
    ctr0  elem // 16                             the block of 16 words that holds element elem
    ctr1  the sequence's row in the step's global batch (row0 + its index in this batch)
    ctr2  (layer + 1) << 32 | site << 24 | head  site 0 the embedding (layer -1), 1 the attention
                                                 probabilities (head: the global head), 2 the
                                                 attention output, 3 the MLP output; head 0 else
    ctr3  step
    elem  query S + key for the attention probabilities, position C + channel for a (B, S, C)
          activation: row-major in its sequence's (S, S) or (S, C) array

Element elem takes word elem of its stream, u (16 bits), and is kept when u >= round(p 2^16):
the drop probability is p rounded to a multiple of 2^-16 (at most 7.6e-6 off; FlashAttention
rounds it to 8 bits), and the scale is 1/(1 - that p), so a mask times its scale has expectation
1 exactly. 16 bits rather than 32 halve the Philox blocks drawn, the bulk of the cost (numpy's
Philox took 3.2 ms for the 2^19 64-bit outputs of the masks below, 6.2 ms for 2^20).

Masks are bool, 1 byte per element (as Korthikanti et al. 2022 count them); the scale is applied
where a mask is applied (`Masks.apply`, and inside kernels.attention_forward), never stored.

Timing, one layer's attention-probability masks at B 8, H 4, S 256, p 0.1 (T = 1), median of 30
calls taken in turns, one BLAS thread, on the 2-core build machine (`lscpu`: Intel Xeon @ 2.60 GHz,
Ice Lake, KVM guest), shared with other jobs (under their load every figure grew, up to 6x, while
"before" stayed about 3x "now"):

    OMP_NUM_THREADS=1 python experiments/kernels/dropout_masks.py
    before: a numpy Generator per head and sequence, float32 0 or 1/(1-p)   12.8 ms   8 MiB
    now: Philox by counter, bool                                             4.3 ms   2 MiB
    for scale, the two attention GEMMs (q k^T and probs v, hs 64)            7.5 ms
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core import backend
from mpi_tp.core.philox import split_key, stream_rows, stream_words

WORD = 1 << 16                   # each element compares one 16-bit word of its stream
ATTENTION = 1                    # the site of the attention probabilities (see above)


def site_word(layer: int, site: int, head=0):
    """Counter word ctr2 of (layer, site, head); head may be an integer array of global heads."""
    if not (0 <= layer + 1 < 1 << 32 and 0 <= site < 1 << 8):
        raise ValueError(f"dropout site (layer {layer}, site {site}) does not fit the Philox counter")
    if numpy.any(numpy.asarray(head) >= 1 << 24):
        raise ValueError("more than 2^24 heads do not fit the Philox counter")
    return (layer + 1) << 32 | site << 24 | numpy.asarray(head, dtype=numpy.uint64)


class Dropout:
    """A model's dropout: its probability p, seed and step counter, and whether it is training.

    The masks themselves are drawn by a pass's Masks (below), made once per micro-batch by whoever
    starts its forward (`masks`); the step counter advances once per training step (`advance`), by
    the model that ran it, and is saved with checkpoints (mpi_tp.checkpoint.read.rng_state).
    """

    def __init__(self, p: float, seed: int):
        self.p, self.seed, self.step, self.training = p, seed, 0, True

    @property
    def active(self) -> bool:
        return self.training and self.p > 0

    def masks(self, row0: int = 0, step: int | None = None) -> "Masks | None":
        """The key of a pass's masks: this step's (or `step`'s), for a batch whose first sequence is row
        row0 of the step's global batch; None when no mask is drawn (evaluation, or no dropout
        probability)."""
        return Masks(self.p, self.seed, self.step if step is None else step, row0) if self.active else None

    def advance(self) -> None:
        """The next training step draws fresh masks."""
        self.step += 1


@dataclass(frozen=True)
class Masks:
    """Inverted dropout whose masks are drawn by counter: (seed, step, layer, site[, head], row, position).

    Keying by site instead of drawing from one running generator gives Megatron's
    semantics for free: a mask keyed by a global head index differs between the
    ranks that own different heads, and a mask keyed only by the layer is the same
    on every rank of the group. Keying by the sequence's index in the global batch
    (row0 is this batch's first) and by the global position makes every mask the
    same at every layout, so dropout runs are exactly comparable across tensor,
    data, sequence and pipeline parallelism. Frozen: activation recomputation keeps
    the pass's Masks and draws the same masks again.
    """

    p: float
    seed: int
    step: int
    row0: int = 0            # index of this batch's first sequence in the step's global batch

    @property
    def threshold(self) -> int:
        """Words below it drop their element: p 2^16, rounded (at most 2^16 - 1, so p < 1 keeps some)."""
        return min(round(self.p * WORD), WORD - 1)

    @property
    def scale(self) -> float:
        """1/(1 - p) for the p the threshold draws (a Python float: it never upcasts float32)."""
        return 1.0 / (1.0 - self.threshold / WORD)

    def keep(self, B, layer, site, start, stop, heads=None):
        """The bool masks of elements start ... stop - 1 of the streams of this batch's B rows:
        (B, stop - start), or with heads (global head indices, H_i of them) (B, H_i, stop - start)."""
        rows = numpy.arange(self.row0, self.row0 + B, dtype=numpy.uint64)
        if heads is None:
            ctr2 = site_word(layer, site)
        else:
            rows, ctr2 = rows[:, None], site_word(layer, site, numpy.asarray(list(heads)))[None, :]
        return stream_words(split_key(self.seed), rows, ctr2, self.step, start, stop, xp=backend.xp(),
                            at_least=self.threshold)

    def head_masks(self, B, S, heads, layer):
        """Attention-probability masks, bool (B, H_i, S, S), for the global heads `heads` only."""
        return self.keep(B, layer, ATTENTION, 0, S * S, heads).reshape(B, len(heads), S, S)

    def tile(self, B, S, heads, layer, t0, n, s0, m):
        """The part of head_masks(B, S, heads, layer) at queries t0 ... t0 + n - 1 and keys s0 ... s0 + m - 1,
        bool (B, H_i, n, m), drawn alone (the same bits: each element is named by its position)."""
        rows = numpy.arange(self.row0, self.row0 + B, dtype=numpy.uint64)[:, None]
        ctr2 = site_word(layer, ATTENTION, numpy.asarray(list(heads)))[None, :]
        return stream_rows(split_key(self.seed), rows, ctr2, self.step, range(t0 * S + s0, (t0 + n) * S + s0, S), m,
                           xp=backend.xp(), at_least=self.threshold)

    def apply(self, x, mask):
        """x * mask / (1 - p): a fresh array of x's dtype (mask bool, broadcastable to x)."""
        out = x * mask
        out *= self.scale
        return out


def region_mask(masks: Masks, y, sp, layer, site, cp=None):
    """The bool dropout mask of a replicated activation y (B, S, C) or, under sequence parallelism
    (sp, a SequenceSplit), of this rank's positions y (B, S_i, C): only those are drawn. Under context
    parallelism (cp, a ContextSplit) the rows are this rank's chunks: each run of global positions drawn."""
    B, S_here, C = y.shape
    positions = slice(0, S_here) if sp is None else sp.positions
    if cp is None:
        return masks.keep(B, layer, site, positions.start * C, positions.stop * C).reshape(B, S_here, C)
    runs = [masks.keep(B, layer, site, a * C, b * C).reshape(B, b - a, C) for a, b in cp.global_runs(positions)]
    return runs[0] if len(runs) == 1 else backend.xp().concatenate(runs, axis=1)


class TileMasks:
    """The attention dropout of one layer drawn tile by tile, for the online softmax (mpi_tp.core.kernels_online)
    and ring attention: no (S, S) mask is held. Called as mask_of(rows, cols) with the tile's query and key
    slices at global positions (offsets t0 and s0 added to local ones: a context-parallel rank's runs). A
    strip of query rows is drawn once, over the keys its queries see (`span`: (lo, hi) of the strip's rows),
    and its tiles are slices of it; without `span` each tile is drawn by itself (ring attention: a rank's
    tiles are whole chunk pairs, each computed once per pass)."""

    def __init__(self, masks: Masks, B: int, S: int, heads, layer: int, span=None):
        self.masks, self.B, self.S, self.heads, self.layer, self.span = masks, B, S, list(heads), layer, span
        self.strip = (None, None, None)                  # (rows, lo, the strip's mask)

    def __call__(self, rows: slice, cols: slice, t0: int = 0, s0: int = 0):
        n, m = rows.stop - rows.start, cols.stop - cols.start
        t, s = t0 + rows.start, s0 + cols.start
        if self.span is None:
            return self.draw(t, n, s, m)
        if self.strip[0] != (t, n):
            lo, hi = self.span(t, n)
            self.strip = ((t, n), lo, self.draw(t, n, lo, hi - lo))
        _, lo, strip = self.strip
        return strip[..., s - lo:s - lo + m]

    def draw(self, t, n, s, m):
        return self.masks.tile(self.B, self.S, self.heads, self.layer, t, n, s, m)
