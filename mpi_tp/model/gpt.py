"""A GPT-2 style transformer whose every layer is split across the tensor-parallel group.

Legend: B = batch, T = sequence, C = channels (n_embd), H = heads, D = C/H head
size, V = vocabulary; H_p, F_p, V_p = this rank's heads, MLP width and
vocabulary rows (uneven shards allowed).

    x = wte[idx] + wpe[0:T]                       wte vocab-parallel (1 all-reduce)
    for each block:
        x = x + attn(ln_1(x))                     heads split: f, q/k/v column, proj row, g
        x = x + mlp(ln_2(x))                      fc column, gelu, proj row, g
    logits_p = ln_f(x) @ wte_p^T                  tied head, this rank's vocab columns (f)
    loss = vocab-parallel cross-entropy           2 small all-reduces, no gather

Per block the forward pass all-reduces twice (after attention, after the MLP)
and so does the backward (the two f's), B*T*C values each (Megatron-LM, sec. 3).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy

from . import backend
from . import kernels as K
from .layers import ColumnParallelLinear, LayerNorm, RowParallelLinear, SequenceSplit, VocabParallelEmbedding
from .loss import VocabParallelCrossEntropy
from .module import Module
from .params import make_param
from .topology import Topology, TopologyError, check_splittable, offsets, split_sizes


class ConfigError(ValueError):
    """A model or run configuration that cannot work; the message says what to change."""


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64      # longest sequence (positions in wpe)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def validate(self, tp: int = 1) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"{key} must be a positive integer, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_head = {self.n_head} must divide n_embd = {self.n_embd} "
                              f"(head size = n_embd / n_head)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if tp > self.n_head:
            raise ConfigError(f"tensor-parallel size {tp} exceeds n_head = {self.n_head}: every rank "
                              f"needs at least one attention head; use at most {self.n_head} ranks "
                              f"or more heads")
        try:
            check_splittable(self.vocab_size, tp, "vocab_size")
        except TopologyError as e:
            raise ConfigError(str(e)) from None

    def to_dict(self) -> dict:
        return asdict(self)


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

    def head_masks(self, B, T, heads, dtype, layer):
        """Attention-probability masks (B, H_p, T, T), one stream per global head index."""
        return backend.xp().stack([self.mask((B, T, T), dtype, layer, 1, h) for h in heads], axis=1)


class ParallelAttention(Module):
    """Causal self-attention with the heads divided among the tensor-parallel ranks."""

    def __init__(self, name, cfg: GPTConfig, topo: Topology, dtype, seed, dropout: Dropout, layer: int, sp=None):
        tp = topo.tp
        self.group, self.dropout, self.layer = tp, dropout, layer
        C, H = cfg.n_embd, cfg.n_head
        self.D = C // H
        head_sizes = split_sizes(H, tp.size)
        self.H_p = head_sizes[tp.rank]
        self.heads = range(offsets(head_sizes)[tp.rank], offsets(head_sizes)[tp.rank] + self.H_p)
        cols = [h * self.D for h in head_sizes]   # the q/k/v column split follows the head split
        # q, k and v: three column-parallel layers behind one f, computed as one GEMM (parts)
        self.qkv = ColumnParallelLinear(name, C, C, tp, dtype, sizes=cols, seed=seed, parts=("q", "k", "v"),
                                        sp=sp)
        self.proj = RowParallelLinear(f"{name}/proj", C, C, tp, dtype, sizes=cols, seed=seed,
                                      std=0.02 / math.sqrt(2 * cfg.n_layer), sp=sp)

    def forward(self, x):
        qkv = self.qkv.forward(x)                                        # (B, T, 3 H_p D): [q_i | k_i | v_i]
        B, T = qkv.shape[:2]                                             # T: the whole sequence, also under sp
        qkv = qkv.reshape(B, T, 3, self.H_p, self.D)
        # one copy into head-major order, so that the batched attention products see contiguous heads
        q, k, v = backend.xp().ascontiguousarray(qkv.transpose(2, 0, 3, 1, 4))  # each (B, H_p, T, D)
        mask = (self.dropout.head_masks(B, T, self.heads, x.dtype, self.layer)
                if self.dropout.active else None)
        y, cache = K.attention_forward(q, k, v, mask)                    # (B, H_p, T, D)
        self.save_cache(cache)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, self.H_p * self.D)     # (B, T, H_p*D), rank's columns
        return self.proj.forward(y)                                      # row split + g -> (B, T, C)
                                                                         # (sp: reduce-scatter -> (B, T_i, C))

    def backward(self, dout):
        dy = self.proj.backward(dout)                                    # (B, T, H_p*D)
        B, T = dy.shape[:2]
        dy = dy.reshape(B, T, self.H_p, self.D)
        grads = K.attention_backward(dy.transpose(0, 2, 1, 3), *self.take_cache())
        dqkv = backend.xp().empty((B, T, 3, self.H_p, self.D), dtype=dout.dtype)
        for j, d in enumerate(grads):                                    # dq, dk, dv: (B, H_p, T, D)
            dqkv[:, :, j] = d.transpose(0, 2, 1, 3)
        return self.qkv.backward(dqkv.reshape(B, T, 3 * self.H_p * self.D))   # one GEMM, f's all-reduce


class ParallelMLP(Module):
    """fc (column split, C -> 4C) -> GELU on each rank's columns -> proj (row split, 4C -> C) -> g."""

    def __init__(self, name, cfg: GPTConfig, topo: Topology, dtype, seed, sp=None):
        C = cfg.n_embd
        self.fc = ColumnParallelLinear(f"{name}/fc", C, 4 * C, topo.tp, dtype, seed=seed, sp=sp)
        self.proj = RowParallelLinear(f"{name}/proj", 4 * C, C, topo.tp, dtype, sizes=self.fc.sizes,
                                      seed=seed, std=0.02 / math.sqrt(2 * cfg.n_layer), sp=sp)

    def forward(self, x):
        h = self.fc.forward(x)                     # (B, T, C) -> (B, T, F_p)
        h, cache = K.gelu_forward(h)
        self.save_cache(cache)
        return self.proj.forward(h)                # (B, T, F_p) -> (B, T, C), all-reduced

    def backward(self, dout):
        dh = self.proj.backward(dout)
        dh = K.gelu_backward(dh, *self.take_cache())
        return self.fc.backward(dh)


def _region_mask(dropout: Dropout, y, sp, layer, site):
    """The dropout mask of a replicated (or, under sp, sequence-split) activation y (B, T or T_i, C)."""
    if sp is None:
        return dropout.mask(y.shape, y.dtype, layer, site)
    B, _, C = y.shape
    return dropout.mask((B, sum(sp.sizes), C), y.dtype, layer, site, positions=sp.positions)


class Block(Module):
    """x = x + drop(attn(ln_1(x))); x = x + drop(mlp(ln_2(x)))."""

    def __init__(self, i, cfg, topo, dtype, seed, dropout: Dropout, sp=None):
        name = f"h/{i}"
        self.i, self.dropout, self.sp = i, dropout, sp
        self.ln_1 = LayerNorm(f"{name}/ln_1", cfg.n_embd, dtype)
        self.attn = ParallelAttention(f"{name}/attn", cfg, topo, dtype, seed, dropout, i, sp)
        self.ln_2 = LayerNorm(f"{name}/ln_2", cfg.n_embd, dtype)
        self.mlp = ParallelMLP(f"{name}/mlp", cfg, topo, dtype, seed, sp)

    def _residual_drop(self, y, site):
        # Outside the parallel regions: one mask for the whole group (keyed by layer and site only;
        # under sequence parallelism each rank keeps its positions of the whole sequence's mask).
        if not self.dropout.active:
            return y, None
        m = _region_mask(self.dropout, y, self.sp, self.i, site)
        return y * m, m

    def forward(self, x):
        a, m_a = self._residual_drop(self.attn.forward(self.ln_1.forward(x)), 2)
        x = x + a
        h, m_h = self._residual_drop(self.mlp.forward(self.ln_2.forward(x)), 3)
        self.save_cache(m_a, m_h)
        return x + h

    def backward(self, dout):
        m_a, m_h = self.take_cache()
        dh = dout if m_h is None else dout * m_h
        dx = dout + self.ln_2.backward(self.mlp.backward(dh))
        da = dx if m_a is None else dx * m_a
        return dx + self.ln_1.backward(self.attn.backward(da))


class GPT(Module):
    """The whole model on one rank of the tensor-parallel group (tp = 1 is the serial model)."""

    def __init__(self, cfg: GPTConfig, topo: Topology | None = None, dtype="float32", seed: int = 0,
                 sequence_parallel: bool = False):
        topo = Topology.serial() if topo is None else topo
        cfg.validate(topo.tp.size)
        self.cfg, self.topo, self.dtype = cfg, topo, numpy.dtype(dtype)
        self.dropout = Dropout(cfg.dropout, seed)
        # Sequence parallelism: between the parallel regions each rank holds its positions only.
        self.sp = SequenceSplit(topo.tp) if sequence_parallel else None
        self.wte = VocabParallelEmbedding("wte", cfg.vocab_size, cfg.n_embd, topo.tp, self.dtype, seed=seed,
                                          sp=self.sp)
        self.wpe = make_param("wpe", (cfg.block_size, cfg.n_embd), self.dtype, seed=seed)
        self.h = [Block(i, cfg, topo, self.dtype, seed, self.dropout, self.sp) for i in range(cfg.n_layer)]
        self.ln_f = LayerNorm("ln_f", cfg.n_embd, self.dtype)
        self.loss = VocabParallelCrossEntropy(topo.tp, self.wte.start, self.wte.stop)

    def train(self, mode: bool = True) -> "GPT":
        self.dropout.training = mode
        return self

    def eval(self) -> "GPT":
        return self.train(False)

    def hidden(self, idx):
        """(B, T) token ids -> final hidden states (B, T, C) after ln_f, whole on every rank
        (under sequence parallelism: this rank's positions, (B, T_i, C))."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ConfigError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        idx = backend.asarray(idx)
        positions = slice(0, T)
        if self.sp is not None:
            self.sp.set(T)
            positions = self.sp.positions
        x = self.wte.forward(idx) + self.wpe.data[positions]            # (B, T, C) or (B, T_i, C)
        m = None
        if self.dropout.active:
            m = _region_mask(self.dropout, x, self.sp, -1, 0)
            x *= m
        for block in self.h:
            x = block.forward(x)
        self.save_cache(positions, m)
        return self.ln_f.forward(x)

    def forward(self, idx, targets=None):
        """Loss (a float, the same on every rank) when targets are given, else this rank's logits (B, T, V_p)."""
        logits = self.wte.logits_forward(self.hidden(idx))              # (B, T, V_p)
        if targets is None:
            return logits
        loss = self.loss.forward(logits, backend.asarray(targets))
        if self.dropout.training:
            self.dropout.step += 1                                      # next call draws fresh masks
        return loss

    def backward(self, dloss: float = 1.0, reducer=None) -> None:
        """Accumulate d(dloss * loss)/d(param) into every Param.grad.

        reducer: a data_parallel.GradReducer, told when each block's gradients are
        final (so it can start their all-reduce) and finished at the end.
        """
        dx = self.ln_f.backward(self.wte.logits_backward(self.loss.backward(dloss)))
        positions, m = self.take_cache()
        for i in reversed(range(len(self.h))):
            dx = self.h[i].backward(dx)
            self._sum_sequence_split_grads(self.h[i])
            if reducer is not None:
                reducer.block_done(i)
        if m is not None:
            dx = dx * m
        self.wpe.grad[positions] += dx.sum(axis=0)
        self.wpe.fresh = False
        self._sum_sequence_split_grads(self.ln_f, self.wpe)
        self.wte.backward(dx)
        if reducer is not None:
            reducer.finish()

    def _sum_sequence_split_grads(self, *owners) -> None:
        """Under sequence parallelism a replicated parameter (LayerNorm, row-parallel bias, wpe) saw
        only this rank's positions: its gradient is the sum over the group (one packed all-reduce)."""
        if self.sp is None or self.topo.tp.size == 1:
            return
        params = [p for o in owners for p in (o.parameters() if isinstance(o, Module) else [o])
                  if not p.sharded]
        xp = backend.xp()
        buf = xp.concatenate([p.grad.reshape(-1) for p in params])
        self.topo.tp.all_reduce(buf, kind="sp_grad_all_reduce")
        at = 0
        for p in params:
            p.grad[...] = buf[at:at + p.grad.size].reshape(p.grad.shape)
            at += p.grad.size

    def full_logits(self, idx):
        """Logits over the whole vocabulary (B, T, V) on every rank: for sampling and tests, not training."""
        from .comm import gather_from_tp
        return gather_from_tp(self.forward(idx), self.topo.tp, self.wte.sizes)

    def num_params(self) -> int:
        """Parameters of the full model (not of this rank's shard)."""
        return sum(int(numpy.prod(p.global_shape)) for p in self.parameters())
