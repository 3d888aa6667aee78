"""The loss kernel pair: the mean next-token cross-entropy over the whole vocabulary, and its gradient.

    loss, cache = cross_entropy_forward(logits, targets)     # logits (..., V), integer targets (...)
    dlogits = cross_entropy_backward(dloss, cache)

The serial reference of the vocabulary-parallel loss (mpi_tp.model.parallel_cross_entropy, which never
gathers the logits). Re-exported by mpi_tp.core.kernels with the other pairs.
"""
from __future__ import annotations

from mpi_tp.core import precision
from mpi_tp.core.backend import array_module


def cross_entropy_forward(logits, targets):
    """Mean over all positions of -log softmax(logits)[target], as a Python float.

    logits (..., V), integer targets (...). The cache holds the probabilities. 16-bit logits: all of it in
    fp32 (the probabilities kept in fp32, as Megatron's), dlogits rounded once to the logits' format.
    """
    if precision.is_half(logits):
        loss, (probs, t, shape, _) = cross_entropy_forward(precision.widen(logits), targets)
        return loss, (probs, t, shape, logits.dtype)
    xp = array_module(logits)
    V = logits.shape[-1]
    logits2 = logits.reshape(-1, V)                    # (..., V) -> (N, V)
    t = targets.reshape(-1)                            # (...) -> (N,)
    N = logits2.shape[0]
    rows = xp.arange(N)
    shifted = logits2 - logits2.max(axis=1, keepdims=True)  # (N, V), stable: max entry is 0
    probs = xp.exp(shifted)                            # (N, V)
    sumexp = probs.sum(axis=1)                         # (N, V) -> (N,)
    # -log p[target] = log(sum exp) - shifted[target]; never log(0) for unlikely targets
    loss = float((xp.log(sumexp) - shifted[rows, t]).mean())
    probs /= sumexp[:, None]
    return loss, (probs, t, logits.shape, logits.dtype)


def cross_entropy_backward(dloss, cache):
    """dlogits (..., V) = dloss * (softmax - onehot(target)) / N."""
    xp = array_module(cache[0])
    probs, t, shape, dtype = cache
    N = probs.shape[0]
    scale = float(dloss) / N                           # Python float: keeps float32
    dlogits = probs * scale                            # (N, V), fresh
    dlogits[xp.arange(N), t] -= scale
    return dlogits.reshape(shape).astype(dtype, copy=False)     # (N, V) -> (..., V), in the logits' format
