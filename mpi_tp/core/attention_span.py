"""Which keys a query attends to: the causal ones, and with a sliding window only the latest W of them.

Legend (docs/notation.md): t a query's position, s a key's, W the window (GPTConfig.sliding_window; None:
no window). Query t sees key s when

    s <= t                  causal
    t - s < W               within the window: the W latest positions, t itself included (Mistral's rule,
                            transformers' sliding_window)

The kernels work on tiles: the queries t0 ... t0 + n - 1 against the keys s0 ... s0 + m - 1 (positions in
the whole sequence, so a context-parallel rank's tile says where its rows and keys sit). A tile is either
all visible (no mask: `tile_bias` gives None), all hidden (`sees` is False: the kernels skip it), or cut
by the diagonal or the window's edge (an additive bias, 0 where seen and -inf where not, made once per
shape and offset t0 - s0).
"""
from __future__ import annotations

import math

_BIAS = {}


def key_span(t0: int, n: int, window: int | None) -> tuple[int, int]:
    """[lo, hi): the keys that any of the queries t0 ... t0 + n - 1 sees."""
    return (0 if window is None else max(0, t0 - window + 1)), t0 + n


def sees(t0: int, n: int, s0: int, m: int, window: int | None) -> bool:
    """Whether some query of the tile sees some key of it."""
    lo, hi = key_span(t0, n, window)
    return s0 < hi and s0 + m > lo


def tile_bias(t0: int, n: int, s0: int, m: int, window: int | None, dtype, xp):
    """(n, m): 0 where query t0 + i sees key s0 + j, -inf where not; None when it sees every key of the tile."""
    d = t0 - s0                                        # t - s at the tile's corner (0, 0)
    if d - (m - 1) >= 0 and (window is None or d + n - 1 < window):
        return None                                    # every key at or before every query, all in the window
    key = (d, n, m, window, str(dtype), xp.__name__)
    if key not in _BIAS:
        gap = xp.arange(n)[:, None] - xp.arange(m)[None, :] + d              # t - s
        hidden = gap < 0 if window is None else (gap < 0) | (gap >= window)
        bias = xp.zeros((n, m), dtype=dtype)
        bias[hidden] = -math.inf
        if len(_BIAS) > 256:                           # offsets repeat per (tile, window): a small cache
            _BIAS.clear()
        _BIAS[key] = bias
    return _BIAS[key]
