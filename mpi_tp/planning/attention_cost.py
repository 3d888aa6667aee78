"""Attention in the cost model: which kernel a run uses, what it computes and keeps, and ring attention's
messages priced against the blocks computed while they travel.

Legend (docs/notation.md): S = sequence, Z = cp ranks, s = S / Z a rank's positions, B = micro-batch, C =
channels, T = tp ranks, H = heads (H_i = H / T a rank's), hs = C / H; a pass: the forward, or the backward.

    kernel    scores kept      QK^T and AV FLOPs (one forward)        passes            elementwise
    flash     none (o, lse)    4 B s (S/2) C / T   the causal half    1 + 2.5 (+1)      fused: 0
    stored    H S^2 B / T      4 B s S C / T       the whole square   3 (+1)            ew_att H s S B / T
    mpi_tp    below ONLINE_FROM (blocked: the probabilities), none from it (online); computed: the whole
              square up to QUERY_BLOCK positions (one dense block), else (S + Q) / 2S of it (blocks of keys
              up to their last query); elementwise as `stored`

`flash` is FlashAttention (Dao 2022, 2023) and what Megatron-Core, TorchTitan and the Llama 3 runs use:
the scores never reach memory, the causal tiles above the diagonal are skipped, and the backward
recomputes the scores (five matrix products to the forward's two: 2.5 passes). `stored` is Megatron's
softmax kernels of 2021-22 (Narayanan et al. 2021, Korthikanti et al. 2022, MT-NLG, BLOOM): the whole
(S, S) scores computed, kept (the 5 a s^2 b term of Korthikanti's count) and normalised by separate
elementwise passes. `auto`: flash on the GPU presets (16-bit Megatron-style activations), mpi_tp's own
kernels on a calibrated machine (this code's CPU path). Ring attention is an online softmax: a `stored`
run priced at cp > 1 computes its rank's positions as `flash` does (`kind_at`).

Ring attention (mpi_tp.parallel.ring_attention) at Z > 1: each pass takes Z steps; at each a rank
computes its queries against the K/V block it holds (half a block pair after the first step: the
causal balance of the two chunks per rank) while the next block travels. A step costs max(compute,
transfer): what is exposed is max(0, transfer - compute), per step

    forward    Z - 1 K/V messages of 2 B s C_kv / T values   against one step's forward block
    backward   Z - 1 steps with K/V and dK/dV both           against one step's backward block
               + the last dK/dV hop home, after the last block (nothing left to hide it)

with C_kv = hs max(H_kv, T) the keys' width (grouped-query attention; C without it; a whole key/value head
on each rank when H_kv < T, mpi_tp.model.heads), the link the cp group
crosses (its placement: inside a node or across), and one more forward ring when the forward is
recomputed.
"""
from __future__ import annotations

from mpi_tp.core.kernels_attention import ONLINE_FROM, QUERY_BLOCK
from mpi_tp.planning.machines import curve_rate

KINDS = ("auto", "flash", "stored", "mpi_tp")
FLASH_BACKWARD = 2.5     # FlashAttention's backward: 5 matrix products (S, dP, dV, dQ, dK) to the forward's 2


def kind(m, w) -> str:
    """The attention kernel a run prices: the Workload's, or `auto`'s choice for the machine."""
    if w.attention not in KINDS:
        raise ValueError(f"attention {w.attention!r}: one of {', '.join(KINDS)}")
    if w.attention != "auto":
        return w.attention
    return "flash" if m.activations == "korthikanti" else "mpi_tp"


def kind_at(m, w, s: float) -> str:
    """The kernel that computes a rank's s of the S positions: a ring (s < S) is an online softmax, FlashAttention's
    (a `stored` run priced with cp: its scores cannot travel in blocks), or mpi_tp's own ring on the CPU."""
    k = kind(m, w)
    return "flash" if k == "stored" and s < w.seq else k


def keeps_scores(m, w, positions: float, cp: int) -> bool:
    """Whether a layer keeps (H, s, S) scores for its backward: `stored`, or mpi_tp's blocked form (one rank,
    fewer than ONLINE_FROM positions); ring attention (cp > 1) never does."""
    k = kind(m, w)
    return cp == 1 and (k == "stored" or (k == "mpi_tp" and positions < ONLINE_FROM))


def score_passes(m, w, s: float, recompute: bool) -> float:
    """Forward-equivalents of the score products per micro-batch: flash 1 + 2.5 (+ 1 recomputed), else 3 (+1)."""
    if kind_at(m, w, s) == "flash":
        return 1 + FLASH_BACKWARD + (1 if recompute else 0)
    return 4 if recompute else 3


def score_flops(m, w, b: float, s: float, heads_share: float, layers: int, recompute: bool) -> float:
    """FLOPs of QK^T and AV per micro-batch on a rank: 4 B s S C x its heads' share per forward (the causal
    half unless `stored`), times score_passes."""
    square = 4 * b * s * w.seq * w.n_embd * heads_share
    return square * computed_share(m, w, s) * score_passes(m, w, s, recompute) * layers


def computed_share(m, w, s: float) -> float:
    """The share of the (s, S) score square a kernel computes: stored 1, flash 1/2 (the causal tiles), mpi_tp
    1 in one block (S <= QUERY_BLOCK: the dense (S, S) product), else (S + Q) / 2S (its blocks of Q query
    rows take the keys up to their last row: the triangle plus half the diagonal blocks; ring attention's
    chunk pairs about the same)."""
    k = kind_at(m, w, s)
    if k == "stored":
        return 1.0
    if k == "flash":
        return 0.5
    if s == w.seq and w.seq <= QUERY_BLOCK:
        return 1.0
    return min(1.0, (w.seq + QUERY_BLOCK) / (2 * w.seq))


def score_rate(m, w, s: float, gemm: float) -> float:
    """FLOP/s of the score products: FlashAttention's own where the kernel is flash and the machine says it (its
    flash_curve at the rank's s query positions, which are also a ring step's block: small blocks run slower;
    else flash_flops), else the GEMM rate (batched matrix products)."""
    if kind_at(m, w, s) != "flash" or not (m.flash_flops or m.flash_curve):
        return gemm
    return curve_rate(m.flash_curve, s, m.flash_flops)


def score_elements(m, w, b: float, s: float, t: int, layers: int, recompute: bool) -> float:
    """Elementwise work on the scores (softmax, mask, dropout) per micro-batch: ew_att H s S B / T per
    forward-equivalent pass (3, or 4 recomputing), none for flash (fused into its tiles)."""
    if kind_at(m, w, s) == "flash":
        return 0.0
    return layers * m.ew_att * w.n_head * s * w.seq * b / t * ((4 if recompute else 3) / 3)


def ring_exposed(m, w, alpha: float, bw: float, z: int, b: float, s: float, kv_width: float, t: int,
                 step_flops: float, rate: float, recompute: bool) -> float:
    """Seconds of ring messages not hidden by the blocks computed meanwhile, per layer and micro-batch (the
    module docstring): step_flops, one ring step's forward score FLOPs (half a block pair), at `rate`."""
    if z < 2:
        return 0.0
    transfer = alpha + 2 * b * s * kv_width / t * m.bytes_per_value / bw       # one K/V (or dK/dV) block
    forward = step_flops / rate
    backward = forward * (FLASH_BACKWARD if kind_at(m, w, s) == "flash" else 2)
    exposed = (z - 1) * max(0.0, transfer - forward)
    exposed += (z - 1) * max(0.0, 2 * transfer - backward) + transfer
    if recompute:
        exposed += (z - 1) * max(0.0, transfer - forward)
    return exposed


def step_score_flops(w, b: float, s: float, heads_share: float) -> float:
    """One ring step's forward score FLOPs on a rank: its s queries against half of a block of s keys
    (the causal balance), QK^T and AV: 4 B s (s / 2) C x its heads' share."""
    return 4 * b * s * (s / 2) * w.n_embd * heads_share

