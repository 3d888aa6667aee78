"""Dropout whose masks are the same at every parallel layout."""
from __future__ import annotations

from contextlib import contextmanager

import numpy

from mpi_tp.core import backend


class Dropout:
    """Inverted dropout whose masks come from random streams keyed by (seed, step, site, sequence).

    Keying by site instead of drawing from one running generator gives Megatron's
    semantics for free: a mask keyed by a global head index differs between the
    ranks that own different heads, and a mask keyed only by the layer is the same
    on every rank of the group. Keying by the sequence's index in the global batch
    (row0 is this replica's first) and cutting sequence-parallel shards out of the
    whole sequence's mask make every mask the same at every layout, so dropout
    runs are exactly comparable across tensor, data and sequence parallelism.
    """

    def __init__(self, p: float, seed: int):
        self.p, self.seed, self.step, self.training = p, seed, 0, True
        self.row0 = 0            # index of this replica's first sequence in the global batch

    def key(self) -> tuple:
        """What the masks of a forward pass depend on besides their site: (step, row0)."""
        return self.step, self.row0

    @contextmanager
    def replay(self, key: tuple):
        """Draw the masks of the forward pass that had this key (activation recomputation)."""
        now = self.key()
        self.step, self.row0 = key
        try:
            yield
        finally:
            self.step, self.row0 = now

    @property
    def active(self) -> bool:
        return self.training and self.p > 0

    def mask(self, shape, dtype, layer, site, head=None, positions=None):
        """0 or 1/(1-p), of `shape` = (B, ...), one stream per sequence: (seed, step, layer + 1, site[,
        head], global row). positions: the slice of the sequence axis (axis 1 of shape) to keep.

        layer -1 is the embedding; site 1 is attention probabilities (one stream per global
        head), 2 the attention output, 3 the MLP output.
        """
        rows = []
        for b in range(shape[0]):
            key = [self.seed, self.step, layer + 1, site] + ([] if head is None else [head]) + [self.row0 + b]
            keep = numpy.random.default_rng(key).random(shape[1:]) >= self.p
            rows.append(keep if positions is None else keep[positions])
        return backend.asarray(numpy.stack(rows).astype(dtype) / (1.0 - self.p))

    def head_masks(self, B, S, heads, dtype, layer):
        """Attention-probability masks (B, H_i, S, S), one stream per global head index."""
        return backend.xp().stack([self.mask((B, S, S), dtype, layer, 1, h) for h in heads], axis=1)


def region_mask(dropout: Dropout, y, sp, layer, site):
    """The dropout mask of a replicated (or, under sp, sequence-split) activation y (B, S or S_i, C)."""
    if sp is None:
        return dropout.mask(y.shape, y.dtype, layer, site)
    B, _, C = y.shape
    return dropout.mask((B, sum(sp.sizes), C), y.dtype, layer, site, positions=sp.positions)
