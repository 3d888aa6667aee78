"""Prefill and decode with a KV cache: the prompt in one forward pass, then one position per step.

    dec = Decoder(model, batch=2)
    logits = dec.prefill([b"The ", b"Once upon"])    # (2, V) float64, every rank: the next byte's logits
    logits = dec.step([ord("c"), ord(" ")])           # one new position per row, attention over the cache

Without a cache every new byte costs a forward pass over the whole context
(mpi_tp.inference.sampling.sample, kept as the reference); with it a step
reads each rank's share of the weights and of the cache once. The model runs
plain tensor parallelism (no sequence parallelism: a decode step has one
position, nothing to split; a checkpoint saved at any layout, pipelines
included, loads as plain TP at the world size of the job). Rows are
left-padded to the longest prompt; positions count from each row's first
byte, so a padded row computes what it would alone. Mixture-of-experts blocks
run dropless (GPT.moe_dropless), every token independent of the others.

Longer than block_size: each row's context is a window over its own bytes
that depends on nothing but their number n (so a request gets the same bytes
in any batch): the whole row while n <= S = block_size, then the last
S/2 bytes, growing by one per step back to S, then S/2 again, and so on
(`window(n, S)`). When a row's window starts again, the rows are prefilled
again from their windows (the learned positions go only to block_size).
"""
from __future__ import annotations

import numpy

from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.inference.kv_cache import KVCache, attend
from mpi_tp.parallel.tensor_parallel import gather_from_tp


def window(n: int, S: int) -> int:
    """How many of a row's last n bytes it attends to: n up to S, then S/2, S/2 + 1, ..., S, S/2, ..."""
    keep = S // 2
    return n if n <= S else keep + (n - S - 1) % (S - keep + 1)


class Decoder:
    """Cached decoding of `batch` sequences with a GPT (every rank of its tensor-parallel group)."""

    def __init__(self, model, batch: int):
        if getattr(model, "sp", None) is not None or not (model.first and model.last):
            raise UserError("cached decoding runs a whole model with plain tensor parallelism: build it "
                            "without sequence parallelism or pipeline stages (mpi-tp generate does)")
        self.model, self.cache = model, KVCache(model, batch)
        self.tokens = [[] for _ in range(batch)]       # every row's bytes so far (to refill a full cache)

    @property
    def block_size(self) -> int:
        return self.cache.size

    def prefill(self, prompts) -> numpy.ndarray:
        """Start from these prompts (one per row, byte strings or lists of ids, each at least 1 and at
        most block_size long): the next position's logits (B, V), float64, on every rank."""
        if len(prompts) != self.cache.batch:
            raise ValueError(f"{len(prompts)} prompts for a batch of {self.cache.batch}")
        rows = [list(p) for p in prompts]
        if min(len(r) for r in rows) < 1 or max(len(r) for r in rows) > self.block_size:
            raise UserError(f"prompts must hold 1 to {self.block_size} bytes (the model's block_size); "
                            f"got {sorted({len(r) for r in rows})}")
        self.tokens = rows
        return self._refill()

    def step(self, next_ids) -> numpy.ndarray:
        """Append one byte per row: the logits of the position after it (B, V), on every rank."""
        next_ids = numpy.asarray(next_ids, dtype=numpy.int64).reshape(-1)
        for r, i in zip(self.tokens, next_ids):
            r.append(int(i))
        S = self.block_size
        if any(len(r) > S and window(len(r), S) == S // 2 for r in self.tokens):   # a window starts again
            return self._refill()
        return self._forward(next_ids[:, None])

    def _refill(self) -> numpy.ndarray:
        """Every row's window of its bytes, left-padded to the longest, into an empty cache."""
        rows = [r[-window(len(r), self.block_size):] for r in self.tokens]
        longest = max(len(r) for r in rows)
        ids = numpy.zeros((len(rows), longest), dtype=numpy.int64)
        for b, r in enumerate(rows):
            ids[b, longest - len(r):] = r                                   # left padding
        self.cache.reset([longest - len(r) for r in rows])
        return self._forward(ids)

    def _forward(self, ids) -> numpy.ndarray:
        """ids (B, t) at columns cache.length ..: through every block (filling the cache), then the
        last column's logits, gathered over the vocabulary split: (B, V) float64."""
        model, cache = self.model, self.cache
        t = ids.shape[1]
        columns = numpy.arange(cache.length, cache.length + t)
        positions = numpy.maximum(columns[None, :] - cache.first[:, None], 0)   # padding: position 0
        xp = backend.xp()
        emb = model.embedding
        x = emb.wte.forward(backend.asarray(ids)) + emb.wpe.data[backend.asarray(positions)]   # host -> device
        with model.moe_dropless():      # experts: exact one position at a time only without capacity
            for j, block in enumerate(model.h):
                x = x + attend(block.attn, block.ln_1.forward(x), cache, j)
                x = x + block.mlp.forward(block.ln_2.forward(x))
        cache.length += t
        logits_i = model.head.logits(xp.ascontiguousarray(x[:, -1:]))              # (B, 1, V_i)
        logits_i = xp.ascontiguousarray(logits_i[:, 0])                             # (B, V_i)
        return backend.asnumpy(gather_from_tp(logits_i, model.topo.tp, emb.wte.sizes)).astype(numpy.float64)
