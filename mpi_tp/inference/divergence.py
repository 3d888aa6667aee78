"""How far apart two saved models' next-token distributions are on the same text (`mpi-tp compare`).

    d = divergence("runs/a/checkpoints", "runs/b/checkpoints", tokens, comm, windows=8)
    d["mean_kl"], d["max_kl"], d["top1_agreement"], d["tokens"]

The models load one after the other (load_model: tensor-parallel over comm, as `mpi-tp eval` runs them, each
in the format it was saved in), so only one is in memory at a time; A's log-probabilities over the windows
wait on rank 0 for B's: windows x block_size x V float64 numbers (8 x 1024 x 50257 for GPT-2: 3.3 GB).
The windows are eval's (mpi_tp.inference.evaluate.eval_windows: starting at 0, S, 2S, ...), the first
`windows` of them. Every rank calls it; the result is rank 0's (None elsewhere).

    KL(A||B) at a position = sum_v p_A(v) (log p_A(v) - log p_B(v))      nats, >= 0, 0 iff equal
    top-1 agreement        = the share of positions where both put the same token first
"""
from __future__ import annotations

import numpy

from mpi_tp.checkpoint.model import load_model
from mpi_tp.core import backend
from mpi_tp.inference.evaluate import eval_windows


def log_softmax(logits: numpy.ndarray) -> numpy.ndarray:
    """(..., V) -> log-probabilities, float64 (computed there whatever the model's format)."""
    z = logits.astype(numpy.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - numpy.log(numpy.exp(z).sum(axis=-1, keepdims=True))


def log_probs(path: str, tokens: numpy.ndarray, comm, windows: int, batch_size: int = 4):
    """The model at `path`'s next-token log-probabilities (W, S, V) over the first `windows` windows of
    tokens, on rank 0 (None elsewhere); collective over comm."""
    model, _ = load_model(path, comm)
    S, out = model.cfg.block_size, []
    taken = 0
    with model.moe_dropless():             # as generate and serve run it: no token dropped by a capacity
        for x, _ in eval_windows(tokens, S, batch_size):
            x = x[:windows - taken]
            logits = backend.asnumpy(model.full_logits(backend.asarray(x)))        # (B, S, V), every rank
            if comm.Get_rank() == 0:
                out.append(log_softmax(logits))
            taken += len(x)
            if taken == windows:
                break
    del model                              # before the next one loads: one model in memory at a time
    return numpy.concatenate(out) if comm.Get_rank() == 0 else None


def divergence(path_a: str, path_b: str, tokens: numpy.ndarray, comm, windows: int = 8) -> dict | None:
    """KL(A||B) per position (mean and max), top-1 agreement, over the first `windows` windows of tokens;
    on rank 0 (None elsewhere)."""
    la = log_probs(path_a, tokens, comm, windows)
    lb = log_probs(path_b, tokens, comm, windows)
    if comm.Get_rank() != 0:
        return None
    kl = (numpy.exp(la) * (la - lb)).sum(axis=-1)                  # (W, S)
    kl = numpy.maximum(kl, 0.0)            # rounding can leave -1e-17 where the two are equal
    worst = numpy.unravel_index(int(kl.argmax()), kl.shape)
    return {"mean_kl": float(kl.mean()), "max_kl": float(kl.max()),
            "max_at": {"window": int(worst[0]), "position": int(worst[1])},
            "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).mean()),
            "windows": int(kl.shape[0]), "tokens": int(kl.size)}
