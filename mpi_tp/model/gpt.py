"""A GPT-2 style transformer whose every layer is split across the tensor-parallel group.

Legend (docs/notation.md): B = batch, S = sequence, C = channels (n_embd), H =
heads, hs = C/H head size, V = vocabulary, T = tensor-parallel size; a subscript
i is rank i's share (i = 0 ... T-1): H_i heads, F_i MLP columns, V_i vocabulary
rows, wte_i its rows of the embedding table wte (uneven shards allowed; see
mpi_tp.model.parallel_linear).

    x = wte[idx] + wpe[0:S]                       wte vocab-parallel (1 all-reduce)
    for each block:
        x = x + attn(ln_1(x))                     heads split: f, q/k/v column, proj row, g
        x = x + mlp(ln_2(x))                      fc column, gelu, proj row, g
    logits_i = ln_f(x) @ wte_i^T                  tied head, this rank's vocab columns (f)
    loss = vocab-parallel cross-entropy           2 small all-reduces, no gather

Per block the forward pass all-reduces twice (after attention, after the MLP)
and so does the backward (the two f's), B S C values each (Megatron-LM, sec. 3).

Mixture of experts (cfg.moe_experts > 0): the MLP of every moe_every-th block is an
MoEMLP (mpi_tp.model.moe), its experts divided over topo.ep; the loss then adds the
blocks' load-balancing and router z-losses (moe_stats() keeps the parts).
"""
from __future__ import annotations

import contextlib

import numpy

from mpi_tp.core import backend
from mpi_tp.core.module import Module
from mpi_tp.core.params import make_param
from mpi_tp.model.attention import ParallelAttention
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.dropout import Dropout, region_mask
from mpi_tp.model.layernorm import LayerNorm
from mpi_tp.model.mlp import ParallelMLP
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.parallel_cross_entropy import VocabParallelCrossEntropy
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.parallel.sequence_parallel import SequenceSplit, sum_replicated_grads
from mpi_tp.parallel.tensor_parallel import gather_from_tp
from mpi_tp.parallel.topology import Topology


RECOMPUTE = ("none", "selective", "full")


class Block(Module):
    """x = x + drop(attn(ln_1(x))); x = x + drop(mlp(ln_2(x))).

    recompute (set by the model for --recompute full): keep only the block's input for
    the backward pass and run the forward again there, collectives and dropout masks
    included (the masks are keyed, so they come out the same).
    """

    recompute = False

    def __init__(self, i, cfg, topo, dtype, seed, dropout: Dropout, sp=None):
        name = f"h/{i}"
        self.i, self.dropout, self.sp = i, dropout, sp
        self.ln_1 = LayerNorm(f"{name}/ln_1", cfg.n_embd, dtype)
        self.attn = ParallelAttention(f"{name}/attn", cfg, topo, dtype, seed, dropout, i, sp)
        self.ln_2 = LayerNorm(f"{name}/ln_2", cfg.n_embd, dtype)
        self.moe = cfg.is_moe_block(i)
        self.mlp = MoEMLP(f"{name}/moe", cfg, topo, dtype, seed) if self.moe else \
            ParallelMLP(f"{name}/mlp", cfg, topo, dtype, seed, sp)

    def _residual_drop(self, y, site):
        # Outside the parallel regions: one mask for the whole group (keyed by layer and site only;
        # under sequence parallelism each rank keeps its positions of the whole sequence's mask).
        if not self.dropout.active:
            return y, None
        m = region_mask(self.dropout, y, self.sp, self.i, site)
        return self.dropout.apply(y, m), m

    def forward(self, x):
        if not self.recompute:
            return self._forward(x)
        out = self._forward(x)
        self.stash_caches()                          # dropped: the backward computes them again
        self.save_cache(x, self.dropout.key())
        return out

    def _forward(self, x):
        a, m_a = self._residual_drop(self.attn.forward(self.ln_1.forward(x)), 2)
        x = x + a
        h, m_h = self._residual_drop(self.mlp.forward(self.ln_2.forward(x)), 3)
        self.save_cache(m_a, m_h)
        return x + h

    def backward(self, dout):
        if self.recompute:
            x, key = self.take_cache()
            with self.dropout.replay(key):           # the same masks as the first time
                self._forward(x)                     # the caches again (the output is not needed)
        m_a, m_h = self.take_cache()
        dh = dout if m_h is None else self.dropout.apply(dout, m_h)
        dx = dout + self.ln_2.backward(self.mlp.backward(dh))
        da = dx if m_a is None else self.dropout.apply(dx, m_a)
        return dx + self.ln_1.backward(self.attn.backward(da))


class GPT(Module):
    """The model on one rank of the tensor-parallel group (tp = 1 is the serial model), or, for a
    pipeline, one chunk of it: the blocks `blocks` (default: all), with the embeddings when `first`
    and the final LayerNorm, tied output layer and loss when `last`.

    A chunk that is not first takes the previous chunk's activations (B, S, C)
    (under sequence parallelism (B, S_i, C), after `sp.set(S)` by the caller);
    one that is not last returns its activations, and its backward takes their
    gradient and returns the input's. The last chunk of a pipeline with several
    stages holds its own copy of the tied table `wte` (same name, same initial
    values); the pipeline adds the two copies' gradients (mpi_tp.model.pipeline).
    """

    def __init__(self, cfg: GPTConfig, topo: Topology | None = None, dtype="float32", seed: int = 0,
                 sequence_parallel: bool = False, blocks: range | None = None, first: bool = True,
                 last: bool = True, recompute: str = "none"):
        topo = Topology.serial() if topo is None else topo
        cfg.validate(topo.tp.size, topo.ep.size)
        if cfg.moe_experts and sequence_parallel:
            raise ConfigError("mixture of experts with sequence parallelism is not supported: the router "
                              "and the dispatch need every position on every tensor-parallel rank; "
                              "drop --sequence-parallel (or set moe_experts = 0)")
        if cfg.moe_experts and not (first and last):
            raise ConfigError("mixture of experts with pipeline parallelism is not supported yet: the "
                              "load-balancing losses of every stage would have to reach the loss; use pp = 1 "
                              "(or set moe_experts = 0)")
        self.cfg, self.topo, self.dtype = cfg, topo, numpy.dtype(dtype)
        self.first, self.last = first, last
        self.dropout = Dropout(cfg.dropout, seed)
        # Sequence parallelism: between the parallel regions each rank holds its positions only.
        self.sp = SequenceSplit(topo.tp) if sequence_parallel else None
        if first or last:
            self.wte = VocabParallelEmbedding("wte", cfg.vocab_size, cfg.n_embd, topo.tp, self.dtype, seed=seed,
                                              sp=self.sp)
        if first:
            self.wpe = make_param("wpe", (cfg.block_size, cfg.n_embd), self.dtype, seed=seed)
        blocks = range(cfg.n_layer) if blocks is None else blocks
        self.h = [Block(i, cfg, topo, self.dtype, seed, self.dropout, self.sp) for i in blocks]
        if recompute not in RECOMPUTE:
            raise ConfigError(f"recompute {recompute!r}: use one of {', '.join(RECOMPUTE)}")
        for block in self.h:         # activation recomputation (Korthikanti et al. 2022)
            block.recompute = recompute == "full"
            block.attn.recompute = recompute == "selective"
        if last:
            self.ln_f = LayerNorm("ln_f", cfg.n_embd, self.dtype)
            self.loss = VocabParallelCrossEntropy(topo.tp, self.wte.start, self.wte.stop)

    def train(self, mode: bool = True) -> "GPT":
        self.dropout.training = mode
        return self

    def eval(self) -> "GPT":
        return self.train(False)

    def _embed(self, idx):
        """(B, S) token ids -> wte[idx] + wpe[0:S], dropped out: (B, S, C), or (B, S_i, C) under sp."""
        B, S = idx.shape
        if S > self.cfg.block_size:
            raise ConfigError(f"sequence length {S} exceeds block_size {self.cfg.block_size}")
        idx = backend.asarray(idx)
        positions = slice(0, S)
        if self.sp is not None:
            self.sp.set(S)
            positions = self.sp.positions
        x = self.wte.forward(idx) + self.wpe.data[positions]            # (B, S, C) or (B, S_i, C)
        m = None
        if self.dropout.active:
            m = region_mask(self.dropout, x, self.sp, -1, 0)
            x = self.dropout.apply(x, m)
        return x, (positions, m)

    def hidden(self, inp):
        """Token ids (first chunk) or activations -> this chunk's output activations; for the last
        chunk the final hidden states after ln_f (B, S, C), whole on every rank (under sequence
        parallelism: this rank's positions, (B, S_i, C))."""
        x, embedded = self._embed(inp) if self.first else (inp, None)
        for block in self.h:
            x = block.forward(x)
        self.save_cache(embedded)
        return self.ln_f.forward(x) if self.last else x

    def forward(self, inp, targets=None):
        """Loss (a float, the same on every rank) when targets are given, else this rank's logits
        (B, S, V_i); a chunk that is not last returns its activations."""
        if not self.last:
            return self.hidden(inp)
        logits = self.wte.logits_forward(self.hidden(inp))              # (B, S, V_i)
        if targets is None:
            return logits
        loss = self.loss.forward(logits, backend.asarray(targets))
        self._cross_entropy = loss
        if self.moe_layers():
            loss = loss + sum(m.loss_term for m in self.moe_layers())          # + aux and z-losses
        if self.dropout.training:
            self.dropout.step += 1                                      # next call draws fresh masks
        return loss

    def backward(self, dout=1.0, reducer=None):
        """Accumulate d(dout * loss)/d(param) into every Param.grad (a chunk that is not last: dout is
        the gradient of its output activations). Returns the input activations' gradient, or None
        for the first chunk.

        reducer: a data_parallel.GradReducer, told when each block's gradients are
        final (so it can start their all-reduce) and finished at the end; a pipeline
        chunk gets the view GradReducer.chunk(offset) instead, which numbers the
        blocks within the stage and leaves finishing to the stage.
        """
        replicated = ([*self.ln_f.parameters()] if self.last else []) + ([self.wpe] if self.first else [])
        for m in self.moe_layers():
            m.loss_scale = float(dout)            # their aux and z-losses are part of the loss dout scales
        with sum_replicated_grads(replicated, self.sp):
            if self.last:
                dx = self.ln_f.backward(self.wte.logits_backward(self.loss.backward(dout)))
            else:
                dx = backend.asarray(dout)
            (embedded,) = self.take_cache()
            for i in reversed(range(len(self.h))):
                with sum_replicated_grads(self.h[i].parameters(), self.sp):
                    dx = self.h[i].backward(dx)
                if reducer is not None:
                    reducer.block_done(i)
            if self.first:
                positions, m = embedded
                if m is not None:
                    dx = self.dropout.apply(dx, m)
                self.wpe.grad[positions] += dx.sum(axis=0)
                self.wpe.fresh = False
        if self.first:
            self.wte.backward(dx)
            dx = None
        if reducer is not None:
            reducer.finish()
        return dx

    def last_logits(self, idx):
        """The whole vocabulary's logits at the last position of one sequence idx (1, S): (V,) float64,
        the same on every rank (what sampling needs: V numbers gathered, not S V)."""
        logits_i = self.forward(idx)                                                  # (1, S, V_i)
        last = backend.xp().ascontiguousarray(logits_i[:, -1, :])                     # (1, V_i)
        return backend.asnumpy(gather_from_tp(last, self.topo.tp, self.wte.sizes))[0].astype(numpy.float64)

    def moe_layers(self) -> list:
        """The MoEMLP of every MoE block of this model, in order."""
        return [b.mlp for b in self.h if b.moe]

    @contextlib.contextmanager
    def moe_dropless(self):
        """Inside, the MoE blocks drop no assignment (MoEMLP.dropless), whatever moe_capacity says:
        for inference, where cached decoding (mpi_tp.inference.decode) sees one position at a time and
        a per-sequence capacity would drop otherwise than over the whole sequence. Dense: no effect."""
        layers = self.moe_layers()
        before = [m.dropless for m in layers]
        for m in layers:
            m.dropless = True
        try:
            yield self
        finally:
            for m, was in zip(layers, before):
                m.dropless = was

    def moe_stats(self) -> dict:
        """After a forward with targets: the parts of the loss and each MoE block's routing on this
        replica's batch (cross_entropy + aux_weight * aux_loss + z_weight * z_loss = the loss; aux_loss
        and z_loss summed over blocks, unweighted)."""
        layers = [{"block": b.i, **b.mlp.stats} for b in self.h if b.moe]
        return {"cross_entropy": getattr(self, "_cross_entropy", None),
                "aux_loss": sum(m["aux_loss"] for m in layers), "z_loss": sum(m["z_loss"] for m in layers),
                "aux_weight": self.cfg.moe_aux_weight, "z_weight": self.cfg.moe_z_weight, "layers": layers}

    def unique_parameters(self) -> list:
        """Every parameter once (a pipeline stage leaves out its copy of the tied table)."""
        return self.parameters()

    def full_logits(self, idx):
        """Logits over the whole vocabulary (B, S, V) on every rank: for sampling and tests, not training."""
        return gather_from_tp(self.forward(idx), self.topo.tp, self.wte.sizes)

    def num_params(self) -> int:
        """Parameters of the full model (not of this rank's shard; every expert, wherever it lives)."""
        moe = self.moe_layers()
        in_moe = {id(p) for m in moe for p in m.parameters()}
        return sum(int(numpy.prod(p.global_shape)) for p in self.parameters() if id(p) not in in_moe) + \
            sum(m.num_params() for m in moe)
