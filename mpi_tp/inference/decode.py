"""Prefill and decode with a KV cache: rows join with their prompts, step one position at a time, leave.

    dec = Decoder(model, batch=4)                     # up to 4 rows at once
    logits = dec.join([b"The ", b"Once upon"])        # (2, V) float64, every rank: each row's next byte
    logits = dec.step([ord("c"), ord(" ")])           # one new position per running row
    dec.leave([0])                                    # row 0 is done: the last row takes its slot
    logits = dec.join([b"A new one"])                 # rows join while others run (continuous batching)
    logits = dec.prefill([b"The ", b"Once upon"])     # every row from scratch (generate, bench)

Without a cache every new byte costs a forward pass over the whole context
(mpi_tp.inference.sampling.sample, kept as the reference); with it a step
reads each rank's share of the weights and of the cache once. The model runs
plain tensor parallelism (no sequence parallelism: a decode step has one
position, nothing to split; a checkpoint saved at any layout, pipelines
included, loads as plain TP at the world size of the job). Llama models
decode alike: no position table, but q and k rotated to each row's own
position, the cache holding the key/value heads only (grouped-query
attention: H_kv/H of the multi-head cache). Each row has its
own columns and positions from 0 (mpi_tp.inference.kv_cache), so a row
computes what it would alone, in whatever company and whenever it joined.
Mixture-of-experts blocks run dropless (GPT.moe_dropless), every token
independent of the others.

A decode step multiplies a few rows (one per sequence) by every weight: the
Decoder lays the linear weights out (out, in) once (mpi_tp.core.params.store_out_in,
the values unchanged), so that each of those GEMMs has the weight as its tall
operand (mpi_tp.core.kernels.linear_forward): 4 rows by C 1024 x 3C ran at
a quarter of the weight-read speed with the weight as the wide one. The model
then computes the same numbers (within float rounding) but is no longer trained:
an optimizer refuses its storages.

Longer than block_size: each row's context is a window over its own bytes
that depends on nothing but their number n (so a request gets the same bytes
in any batch): the whole row while n <= S = block_size, then the last
S/2 bytes, growing by one per step back to S, then S/2 again, and so on
(`window(n, S)`). When a row's window starts again, that row alone is
prefilled again from its window (the learned positions go only to block_size;
llama's rotations are trained on 0 ... block_size - 1 alike).
"""
from __future__ import annotations

import numpy

from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.core.params import store_out_in
from mpi_tp.inference.kv_cache import KVCache, attend_prefill, attend_step
from mpi_tp.parallel.tensor_parallel import gather_from_tp


def window(n: int, S: int) -> int:
    """How many of a row's last n bytes it attends to: n up to S, then S/2, S/2 + 1, ..., S, S/2, ..."""
    keep = S // 2
    return n if n <= S else keep + (n - S - 1) % (S - keep + 1)


def compaction(rows: int, leaving) -> list[int]:
    """Rows 0 .. rows - 1 without `leaving`: order[i] = the old row that becomes row i. The last running
    rows fill the holes (only they move); every rank and rank 0's scheduler apply the same order."""
    gone = set(leaving)
    left = rows - len(gone)
    order = list(range(left))
    movers = [r for r in range(left, rows) if r not in gone]
    for hole, mover in zip(sorted(r for r in gone if r < left), movers):
        order[hole] = mover
    return order


class Decoder:
    """Cached decoding of up to `batch` sequences with a GPT (every rank of its tensor-parallel group)."""

    def __init__(self, model, batch: int):
        if getattr(model, "sequence_parallel", False) or not (model.first and model.last):
            raise UserError("cached decoding runs a whole model with plain tensor parallelism: build it "
                            "without sequence parallelism or pipeline stages (mpi-tp generate does)")
        store_out_in(model.parameters())               # few-row GEMMs at the weight-read speed (see above)
        self.model, self.cache = model, KVCache(model, batch)
        self.tokens = []                               # every running row's bytes so far (to refill its window)

    @property
    def block_size(self) -> int:
        return self.cache.size

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def prefill(self, prompts) -> numpy.ndarray:
        """Start again with these prompts as the only rows: their next position's logits (B, V)."""
        self.tokens, self.cache.rows = [], 0
        return self.join(prompts)

    def join(self, prompts) -> numpy.ndarray:
        """New rows after the running ones, from these prompts (byte strings or lists of ids, each 1 to
        block_size long): their next position's logits (J, V), float64, on every rank."""
        rows = [list(p) for p in prompts]
        if not rows:
            return numpy.zeros((0, self.model.cfg.vocab_size))
        if self.rows + len(rows) > self.cache.slots:
            raise ValueError(f"{self.rows} running + {len(rows)} new rows > {self.cache.slots} slots")
        if min(len(r) for r in rows) < 1 or max(len(r) for r in rows) > self.block_size:
            raise UserError(f"prompts must hold 1 to {self.block_size} bytes (the model's block_size); "
                            f"got {sorted({len(r) for r in rows})}")
        first = self.rows
        self.tokens += rows
        self.cache.rows = self.rows
        return self._prefill(slice(first, first + len(rows)), rows)

    def leave(self, leaving) -> list[int]:
        """Drop these rows (indices among the running ones); the order of the rest (see compaction)."""
        order = compaction(self.rows, leaving)
        for new, old in enumerate(order):
            if new != old:
                self.cache.move(old, new)
        self.tokens = [self.tokens[old] for old in order]
        self.cache.rows = self.rows
        return order

    def step(self, next_ids) -> numpy.ndarray:
        """Append one byte per running row: the logits of the position after it (rows, V), every rank."""
        next_ids = numpy.asarray(next_ids, dtype=numpy.int64).reshape(-1)
        if len(next_ids) != self.rows:
            raise ValueError(f"{len(next_ids)} bytes for {self.rows} running rows")
        S = self.block_size
        for r, i in zip(self.tokens, next_ids):
            r.append(int(i))
        again = [b for b, r in enumerate(self.tokens) if len(r) > S and window(len(r), S) == S // 2]
        for b in again:
            self.cache.lengths[b] = 0           # its window starts again: the step writes column 0, then
        logits = self._forward_step(next_ids)   # the prefill below replaces it and its logits
        if again:
            windows = [self.tokens[b][-window(len(self.tokens[b]), S):] for b in again]
            logits[again] = self._prefill(numpy.array(again), windows)
        return logits

    def _prefill(self, rows, prompts) -> numpy.ndarray:
        """These rows (a slice or host indices) from column 0: their prompts right-padded to the longest,
        through every block (filling the cache); each row's last real position's logits (J, V)."""
        model, cache = self.model, self.cache
        t = max(len(p) for p in prompts)
        ids = numpy.zeros((len(prompts), t), dtype=numpy.int64)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = p                                              # right padding
        last = numpy.array([len(p) - 1 for p in prompts])
        where = rows if isinstance(rows, slice) else backend.asarray(rows)  # the cache rows, on the device
        keep = cache.prefill_columns(last + 1, t)                            # (a window shorter than t)
        x = model.embedding.lookup(backend.asarray(ids), slice(0, t))           # host -> device: the ids
        angles = model.h[0].attn.rope.prefill_angles(last + 1, t) if model.h and model.cfg.llama else None
        with model.moe_dropless():      # experts: exact one position at a time only without capacity
            for j, block in enumerate(model.h):
                x = x + attend_prefill(block.attn, block.ln_1.forward(x), cache, j, where, angles, keep)
                x = x + block.mlp.forward(block.ln_2.forward(x))
        cache.lengths[rows] = last + 1
        at = backend.asarray(last) if (last != t - 1).any() else None
        return self._logits(x[:, -1:] if at is None else x[backend.xp().arange(len(prompts)), at][:, None])

    def _forward_step(self, next_ids) -> numpy.ndarray:
        """One position per running row, at its column: through every block, then the logits (rows, V)."""
        model, cache = self.model, self.cache
        ids = backend.asarray(numpy.stack([next_ids, cache.lengths[:self.rows]]))   # host -> device, once
        mask = cache.step_mask(ids[1])                                      # (the positions are the columns)
        x = model.embedding.lookup(ids[0][:, None], ids[1][:, None])
        rope = model.h[0].attn.rope if model.h else None                    # llama: each row's rotation,
        angles = rope.angles(ids[1], cache.size) if rope is not None else None  # once for every block
        with model.moe_dropless():
            for j, block in enumerate(model.h):
                x = x + attend_step(block.attn, block.ln_1.forward(x), cache, j, mask, angles)
                x = x + block.mlp.forward(block.ln_2.forward(x))
        cache.lengths[:self.rows] += 1
        return self._logits(x)

    def _logits(self, x) -> numpy.ndarray:
        """x (rows, 1, C) -> the next byte's logits (rows, V), gathered over the vocabulary split, float64."""
        model, xp = self.model, backend.xp()
        logits_i = model.head.logits(xp.ascontiguousarray(x))                  # (rows, 1, V_i)
        logits_i = xp.ascontiguousarray(logits_i[:, 0])                         # (rows, V_i)
        return backend.asnumpy(gather_from_tp(logits_i, model.topo.tp, model.embedding.wte.sizes)).astype(
            numpy.float64)
