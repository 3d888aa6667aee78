"""Sampling text from any model without a cache: the reference, byte by byte.

Each new byte costs a forward pass over the whole context (cropped to
block_size), so it works with every layout (sequence parallelism, pipeline
stages: anything with last_logits) and is what training samples with at its
end; `mpi-tp generate` and `mpi-tp serve` use the cached decoder instead
(mpi_tp.inference.generate), which tests/test_decode.py checks against this
full forward pass. Every rank of the group runs the same forward passes. Only
the last position's logits are gathered (V values per step, not B S V), and
rank 0's choice of the next byte is broadcast, so every rank extends the same
context.
"""
from __future__ import annotations

import numpy


def sample(model, prompt: bytes | list, n_new: int, temperature: float = 0.8, top_k: int | None = None,
           seed: int = 0) -> bytes | list:
    """prompt + n_new sampled bytes (a list of ids when the prompt is a list of ids: any vocabulary).
    The context is cropped to the model's block_size.

    model: a GPT, or a pipeline stage (mpi_tp.parallel.pipeline.stage), anything with last_logits(ctx)."""
    was_training = model.dropout.training
    model.eval()
    group = model.topo.tp
    rng = numpy.random.default_rng(seed)
    tokens = list(prompt) or [ord("\n")]
    choice = numpy.zeros(1, dtype=numpy.int64)
    for _ in range(n_new):
        ctx = numpy.array([tokens[-model.cfg.block_size:]], dtype=numpy.int64)       # (1, S)
        logits = model.last_logits(ctx) / temperature                                 # (V,), every rank
        if top_k is not None and top_k < logits.size:
            logits[logits < numpy.sort(logits)[-top_k]] = -numpy.inf
        p = numpy.exp(logits - logits.max())
        p /= p.sum()
        if group.rank == 0:
            choice[0] = rng.choice(p.size, p=p)
        group.broadcast(choice)
        tokens.append(int(choice[0]))
    model.train(was_training)
    return bytes(tokens) if isinstance(prompt, (bytes, bytearray)) else tokens


def log_probabilities(logits, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` and the k likeliest tokens' (id, log-probability), likeliest first (ties:
    the lower id first), from one row's logits (V,): log-softmax, log p_i = z_i - logsumexp(z). The model's own
    distribution, before any temperature, top_k or top_p (what OpenAI's and vLLM's logprobs give).
    The server has the whole row on rank 0 already (the decoder gathers the vocabulary split to choose the
    token), so this reads it there: k + 1 values come out of V."""
    z = numpy.asarray(logits, dtype=numpy.float64)
    m = z.max()
    lse = m + numpy.log(numpy.exp(z - m).sum())
    top = numpy.argpartition(-z, k - 1)[:k] if 0 < k < z.size else numpy.arange(z.size if k else 0)
    top = top[numpy.lexsort((top, -z[top]))]                      # by value, then by id
    return float(z[token] - lse), [(int(i), float(z[i] - lse)) for i in top]


def printable(data: bytes) -> str:
    """Sampled bytes as text for a terminal: invalid UTF-8 and control characters (but newlines
    and tabs) are shown as escapes rather than sent raw."""
    text = data.decode("utf-8", errors="backslashreplace")
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)
