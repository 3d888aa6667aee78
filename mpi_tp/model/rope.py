"""Rotary position embeddings (Su et al. 2021) for q and k, per head, in the Llama / Hugging Face layout.

Legend (docs/notation.md): B = batch, S = sequence, hs = head size, n heads (H_i of q, K_i of k on rank i).

    q' = q cos + rotate_half(q) sin      rotate_half([x1, x2]) = [-x2, x1]: dimension j of a head is
    k' = k cos + rotate_half(k) sin      paired with j + hs/2, at angle p / theta^(2j/hs) for position p

The rotation acts inside each head, so it needs no communication and shards with the heads. The
backward is the inverse rotation (mpi_tp.core.kernels_llama). A rope_scaling (Llama 3's, linear) changes
the frequencies alone (mpi_tp.model.rope_scaling). The angles come from the position alone:
the training forward uses 0 ... S-1 (under sequence parallelism attention sees the whole sequence,
gathered, as without it); cached decoding passes each row's own position.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core import kernels_llama as kl
from mpi_tp.core.module import Module

_TABLES = {}


def rope_table(n: int, hs: int, theta: float, dtype, scaling=None):
    """cos, sin (n, hs) for positions 0 ... n-1, on the current backend, made once per shape, dtype and scaling
    (a longer table is made when asked for; its first rows are the same numbers)."""
    xp = backend.xp()
    key = (hs, float(theta), str(dtype), xp.__name__, tuple(sorted((scaling or {}).items())))
    have = _TABLES.get(key)
    if have is None or have[0].shape[0] < n:
        _TABLES[key] = kl.rope_tables(xp.arange(max(n, 2 * (have[0].shape[0] if have else 0))), hs, theta, dtype,
                                      scaling)
    cos, sin = _TABLES[key]
    return cos[:n], sin[:n]


class Rope(Module):
    """Rotates q (B, H_i, S, hs) and k (B, K_i, S, hs) to their positions; backward rotates back."""

    def __init__(self, hs: int, theta: float, dtype, scaling=None):
        self.hs, self.theta, self.dtype, self.scaling = hs, theta, dtype, scaling

    def angles(self, positions, n: int):
        """cos, sin (B, 1, 1, hs) for one position per row: positions (B,) on the device, each below n (a host
        bound: no copy to the host). Cached decoding makes them once per step for every block."""
        cos, sin = rope_table(n, self.hs, self.theta, self.dtype, self.scaling)
        return cos[positions][:, None, None, :], sin[positions][:, None, None, :]

    def forward(self, q, k, angles=None):
        """Rotate q and k: to positions 0 ... S-1 (angles None), or by the given (cos, sin) (Rope.angles)."""
        S = q.shape[-2]
        cos, sin = rope_table(S, self.hs, self.theta, self.dtype, self.scaling) if angles is None else angles
        q, _ = kl.rope_forward(q, cos, sin)
        k, _ = kl.rope_forward(k, cos, sin)
        self.save_cache(S, angles)            # not the table (shared, not an activation): its length
        return q, k

    def backward(self, dq, dk):
        S, angles = self.take_cache()
        cache = rope_table(S, self.hs, self.theta, self.dtype, self.scaling) if angles is None else angles
        return kl.rope_backward(dq, cache), kl.rope_backward(dk, cache)
