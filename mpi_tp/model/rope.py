"""Rotary position embeddings (Su et al. 2021) for q and k, per head, in the Llama / Hugging Face layout.

Legend (docs/notation.md): B = batch, S = sequence, hs = head size, n heads (H_i of q, K_i of k on rank i).

    q' = q cos + rotate_half(q) sin      rotate_half([x1, x2]) = [-x2, x1]: dimension j of a head is
    k' = k cos + rotate_half(k) sin      paired with j + hs/2, at angle p / theta^(2j/hs) for position p

The rotation acts inside each head, so it needs no communication and shards with the heads. The
backward is the inverse rotation (mpi_tp.core.kernels_llama). A rope_scaling (Llama 3's, linear) changes
the frequencies alone (mpi_tp.model.rope_scaling). The angles come from the position alone:
the training forward uses 0 ... S-1 (under sequence parallelism attention sees the whole sequence,
gathered, as without it); cached decoding passes each row's own position.

rope_scaling dynamic (NTK) also reads the sequence's length L: a forward over S positions rotates them all
with L = S (rope_table(S): under context parallelism the whole sequence's S), a prompt's prefill each row
with its own prompt's length (Rope.prefill_angles), a decode step each row's new position p with L = p + 1
(Rope.angles); mpi_tp.model.rope_scaling says how that follows transformers and where it differs.
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core import kernels_llama as kl
from mpi_tp.core.module import Module

_TABLES = {}


def dynamic(scaling) -> bool:
    """Whether the angles depend on the sequence's length (rope_type dynamic) and not on the position alone."""
    return scaling is not None and scaling["rope_type"] == "dynamic"


def rope_table(n: int, hs: int, theta: float, dtype, scaling=None):
    """cos, sin (n, hs) for positions 0 ... n-1 of one forward over n positions, on the current backend, made once
    per shape, dtype and scaling (a longer table is made when asked for; its first rows are the same numbers).
    dynamic: n <= L0 is the default rope's table; a longer n has a table of its own (L = n), only the last kept."""
    xp = backend.xp()
    key = (hs, float(theta), str(dtype), xp.__name__, tuple(sorted((scaling or {}).items())))
    if dynamic(scaling) and n > scaling["original_max_position_embeddings"]:
        have = _TABLES.get(key + ("long",))
        if have is None or have[0].shape[0] != n:
            have = _TABLES[key + ("long",)] = kl.rope_tables(xp.arange(n), hs, theta, dtype, scaling, lengths=n)
        return have
    have = _TABLES.get(key)
    if have is None or have[0].shape[0] < n:
        n_made = max(n, 2 * (have[0].shape[0] if have else 0))
        _TABLES[key] = kl.rope_tables(xp.arange(n_made), hs, theta, dtype, scaling, lengths=1)
    cos, sin = _TABLES[key]
    return cos[:n], sin[:n]


class PassAngles:
    """cos, sin of a context-parallel rank's positions, made once per micro-batch's pass and shared by every
    block (ParallelAttention._ring_forward): kept once, like the rope table, not as each block's activation."""

    def __init__(self, cos, sin):
        self.cos, self.sin = cos, sin


class Rope(Module):
    """Rotates q (B, H_i, S, hs) and k (B, K_i, S, hs) to their positions; backward rotates back."""

    def __init__(self, hs: int, theta: float, dtype, scaling=None):
        self.hs, self.theta, self.dtype, self.scaling = hs, theta, dtype, scaling

    def angles(self, positions, n: int):
        """cos, sin (B, 1, 1, hs) for one position per row: positions (B,) on the device, each below n (a host
        bound: no copy to the host). Cached decoding makes them once per step for every block. dynamic: each
        row's position p rotated for a sequence of p + 1 positions (computed on the device, no table)."""
        if dynamic(self.scaling):
            cos, sin = kl.rope_tables(positions, self.hs, self.theta, self.dtype, self.scaling, lengths=positions + 1)
            return cos[:, None, None, :], sin[:, None, None, :]
        cos, sin = rope_table(n, self.hs, self.theta, self.dtype, self.scaling)
        return cos[positions][:, None, None, :], sin[positions][:, None, None, :]

    def prefill_angles(self, lengths, t: int):
        """cos, sin (J, 1, t, hs) for rows at positions 0 ... t-1 whose sequences are `lengths` (J,) long (host
        integers, each <= t: right-padded prompts), or None where a row's length changes nothing (every type
        but dynamic: the table of 0 ... t-1). dynamic: row b rotated for a sequence of lengths[b] positions."""
        if not dynamic(self.scaling):
            return None
        xp = backend.xp()
        lengths = backend.asarray(lengths, dtype="int64")[:, None]                   # host -> device, (J, 1)
        cos, sin = kl.rope_tables(xp.arange(t)[None, :], self.hs, self.theta, self.dtype, self.scaling, lengths)
        return cos[:, None], sin[:, None]                                                    # (J, 1, t, hs)

    def forward(self, q, k, angles=None):
        """Rotate q and k: to positions 0 ... S-1 (angles None), or by the given (cos, sin) (Rope.angles)."""
        S = q.shape[-2]
        cos, sin = self._cos_sin(S, angles)
        q, _ = kl.rope_forward(q, cos, sin)
        k, _ = kl.rope_forward(k, cos, sin)
        self.save_cache(S, angles)            # not the table (shared, not an activation): its length
        return q, k

    def backward(self, dq, dk):
        S, angles = self.take_cache()
        cache = self._cos_sin(S, angles)
        return kl.rope_backward(dq, cache), kl.rope_backward(dk, cache)

    def _cos_sin(self, S: int, angles):
        if angles is None:
            return rope_table(S, self.hs, self.theta, self.dtype, self.scaling)
        return (angles.cos, angles.sin) if isinstance(angles, PassAngles) else angles
