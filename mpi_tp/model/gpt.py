"""A GPT-2 or Llama style transformer whose every layer is split across the tensor-parallel group.

Legend (docs/notation.md): B = batch, S = sequence, C = channels (n_embd), H =
heads, hs = C/H head size, V = vocabulary, T = tensor-parallel size; a subscript
i is rank i's share (i = 0 ... T-1): H_i heads, F_i MLP columns, V_i vocabulary
rows, wte_i its rows of the embedding table wte (uneven shards allowed; see
mpi_tp.model.parallel_linear).

The model is three kinds of pieces, as in Megatron-LM's GPT (pre-process, blocks, post-process):

    x = drop(wte[idx] + wpe[0:S])                 embedding (GPTEmbedding): wte vocab-parallel, 1 all-reduce
    for each block:                               blocks (Block)
        x = x + drop(attn(ln_1(x)))               heads split: f, q/k/v column, proj row, g
        x = x + drop(mlp(ln_2(x)))                fc column, gelu, proj row, g
    logits_i = ln_f(x) @ wte_i^T                  head (GPTHead): tied, this rank's vocab columns (f)
    loss = vocab-parallel cross-entropy           2 small all-reduces, no gather

Llama (cfg.arch "llama"; mpi_tp.model.llama lists its parameters): no wpe, RMSNorms, rotary q and k,
no biases, grouped-query attention, a SwiGLU MLP, and the output layer tied or its own (lm_head).

A pipeline stage (mpi_tp.parallel.pipeline.stage) builds the pieces it owns: a GPT over a run of
blocks, with the embedding when it is the model's first chunk and the head when it is the last;
nothing here knows whether it is pipelined. The backward pass leaves each rank's own gradients;
what the layout needs after the last micro-batch (sums over the sequence-parallel positions, the
tied table's copies, the data-parallel buckets) is mpi_tp.parallel.finalize.finalize_grads.

Context parallelism (topo.cp larger than one rank): the model takes whole sequences and each rank
keeps its two chunks of them (mpi_tp.parallel.context_parallel) from the embedding to the loss;
attention is ring attention over topo.cp; the loss returned is the whole sequence's.

Mixture of experts (cfg.moe_experts > 0): the MLP of every moe_every-th block is an
MoEMLP (mpi_tp.model.moe), its experts divided over topo.ep; the loss then adds the
blocks' load-balancing and router z-losses (moe_stats() keeps the parts).
"""
from __future__ import annotations

import contextlib

import numpy

from mpi_tp.core import backend
from mpi_tp.core.module import Module
from mpi_tp.core.precision import dtype_of
from mpi_tp.core.weight_grads import weight_grad
from mpi_tp.model.block import Block
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.dropout import Dropout
from mpi_tp.model.embedding import GPTEmbedding
from mpi_tp.model.forward_pass import Pass
from mpi_tp.model.head import GPTHead
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.parallel.context_parallel import loss_weight
from mpi_tp.parallel.fsdp import WHOLE
from mpi_tp.parallel.tensor_parallel import gather_from_tp
from mpi_tp.parallel.topology import Topology

RECOMPUTE = ("none", "selective", "full")


class GPT(Module):
    """The model on one rank of the tensor-parallel group (tp = 1 is the serial model), or one chunk of
    it: the blocks `blocks` (default: all), with the embedding when `first` and the head when `last`.

    A chunk that is not first takes the previous chunk's activations (B, S, C)
    (under sequence parallelism (B, S_i, C)) and its micro-batch's pass;
    one that is not last returns its activations, and its backward takes their
    gradient and returns the input's. A last chunk that is not also the first
    holds its own copy of the tied table `wte` (same name, same initial values);
    an untied output layer (llama) is the table `lm_head`, on the last chunk only.
    """

    def __init__(self, cfg: GPTConfig, topo: Topology | None = None, dtype="float32", seed: int = 0,
                 sequence_parallel: bool = False, blocks: range | None = None, first: bool = True,
                 last: bool = True, recompute: str = "none", dropout: Dropout | None = None):
        """dropout: the Dropout state to share (a pipeline stage's chunks share one); default a new one."""
        topo = Topology.serial() if topo is None else topo
        cfg.validate(topo.tp.size, topo.ep.size, topo.etp.size)
        if recompute not in RECOMPUTE:
            raise ConfigError(f"recompute {recompute!r}: use one of {', '.join(RECOMPUTE)}")
        self.cfg, self.topo, self.dtype = cfg, topo, dtype_of(dtype)     # float32, float64, bfloat16, float16
        self.first, self.last = first, last
        self.fsdp = WHOLE            # --zero 3: an FSDP (mpi_tp.parallel.fsdp), gathering each piece before use
        self.dropout = Dropout(cfg.dropout, seed) if dropout is None else dropout
        # Sequence parallelism: between the parallel regions each rank holds its positions only.
        self.sequence_parallel = sequence_parallel
        self.sp_overlap = None       # SequenceSplit.overlap of its passes (None: MPI_TP_SP_OVERLAP's default)
        # Context parallelism (topo.cp): every layer on this rank's chunks of the sequence only.
        sp = sequence_parallel
        self._loss_scale = 1.0
        self.embedding = GPTEmbedding(cfg, topo, self.dtype, seed, sp) if first else None
        blocks = range(cfg.n_layer) if blocks is None else blocks
        self.h = [Block(i, cfg, topo, self.dtype, seed, sp) for i in blocks]
        for block in self.h:         # activation recomputation (Korthikanti et al. 2022)
            block.recompute = recompute == "full"
            block.attn.recompute = recompute == "selective"
        self.head = None
        if last:
            if cfg.tied and first:
                table = self.embedding.wte
            else:                    # the tied table's copy (same name, same values), or lm_head
                table = VocabParallelEmbedding("wte" if cfg.tied else "lm_head", cfg.vocab_size, cfg.n_embd,
                                               topo.tp, self.dtype, seed=seed)
            self.head = GPTHead(cfg, topo, self.dtype, table, sp)

    def train(self, mode: bool = True) -> "GPT":
        self.dropout.training = mode
        return self

    def eval(self) -> "GPT":
        return self.train(False)

    def new_pass(self, S: int, row0: int = 0, step: int | None = None) -> Pass:
        """The pass of a micro-batch of sequences of S positions whose first is row row0 of the step's
        global batch: this layout's cuts of the positions, this step's (or `step`'s) dropout masks."""
        return Pass.start(self.topo, S, self.sequence_parallel, self.dropout.masks(row0, step), self.sp_overlap,
                          row0)

    def hidden(self, inp, ps: Pass):
        """Token ids (first chunk) or activations -> the activations after this chunk's blocks:
        (B, S, C), or this rank's positions (B, S_i, C) under sequence parallelism."""
        self.fsdp.forward("embedding")               # ZeRO-3: each piece's parameters gathered before it runs
        x = self.embedding.forward(inp, ps) if self.first else inp
        for i, block in enumerate(self.h):
            self.fsdp.forward(i)
            x = block.forward(x, ps)
        self.fsdp.forward("head")
        return x

    def forward(self, inp, targets=None, ps: Pass | None = None):
        """Loss (a float, the same on every rank) when targets are given, else this rank's logits
        (B, S, V_i); a chunk that is not last returns its activations. The loss includes this chunk's
        MoE blocks' aux and z-losses (a pipeline adds the other stages': moe_loss()).
        ps: the micro-batch's pass; without one, a first chunk starts its own (row 0 of this step's
        batch) and, training with targets, moves its dropout to the next step afterwards."""
        own = ps is None
        if own:
            if not self.first:
                raise ValueError("a model chunk that is not the first needs its micro-batch's pass (ps)")
            ps = self.new_pass(inp.shape[1])
        x = self.hidden(inp, ps)
        if not self.last:
            return x
        if targets is None:
            return self.head.forward(x, sp=ps.sp)
        if ps.cp is None:
            loss = self.head.forward(x, targets, ps.sp)
        else:        # this rank's mean, weighted for the reducer (loss_weight); the whole sequence's mean
            self._loss_scale = loss_weight(ps.cp, ps.cp.length())
            mine = self.head.forward(x, ps.cp.take(targets), ps.sp) * self._loss_scale
            loss = float(ps.cp.group.all_reduce(numpy.array([mine]))[0]) / ps.cp.group.size
        self._cross_entropy = loss
        loss = loss + self.moe_loss()
        if own and self.dropout.training:
            self.dropout.advance()                                      # the next call draws fresh masks
        return loss

    def moe_loss(self) -> float:
        """What this chunk's MoE blocks add to the loss after a forward (weighted aux + z-losses); 0 dense.
        The blocks keep their terms on the device: one copy to the host for all of them."""
        layers = self.moe_layers()
        return float(sum(m.loss_term for m in layers)) if layers else 0.0

    def backward(self, dout=1.0, reducer=None, loss_scale=None, grads=None):
        """Accumulate this rank's d(loss_scale * loss)/d(param) into every Param.grad; a chunk that is not
        last takes the gradient of its output activations as dout. Returns the input activations'
        gradient, or None for the first chunk.

        The gradients are this rank's own: finalize_grads (mpi_tp.parallel.finalize) completes them
        after the last micro-batch. reducer: a data_parallel.GradReducer (or a pipeline chunk's view
        of one, GradReducer.chunk(offset)), told when each block's gradients are final so that it can
        start their bucket's collectives during the rest of the backward pass.
        loss_scale: the factor on the loss, for the MoE blocks' own loss terms (default: dout when
        last, else 1; a pipeline passes 1 / micro-batches).
        grads: ZeRO-2's GradReducer.grads(offset), told before each block's backward (need(i); None: the
        head's and the embedding's) so that it can make the gradient buffers it dropped; or None.
        """
        scale = (float(dout) if self.last else 1.0) if loss_scale is None else loss_scale
        for m in self.moe_layers():
            m.loss_scale = scale            # their aux and z-losses are part of the loss it scales
        self.fsdp.backward("head")                   # ZeRO-3: gathered again, each piece's gradients reduced
        if grads is not None and (self.last or self.first):
            grads.need(None)                         # ZeRO-2: the head's and embedding's whole gradients, made
        dx = self.head.backward(dout * self._loss_scale) if self.last else backend.asarray(dout)
        for i in reversed(range(len(self.h))):
            self.fsdp.backward(i)
            if grads is not None:
                grads.need(i)
            dx = self.h[i].backward(dx)
            if reducer is not None:          # after the block's W, which may be deferred (core.weight_grads)
                weight_grad(reducer.block_done, i)
        self.fsdp.backward("embedding")
        if self.first:
            self.embedding.backward(dx)
        self.fsdp.backward("end")
        return None if self.first else dx

    def last_logits(self, idx, ps: Pass | None = None):
        """The whole vocabulary's logits at the last position of one sequence idx (1, S): (V,) float64,
        the same on every rank (what sampling needs: V numbers gathered, not S V)."""
        if self.topo.cp.size > 1:
            raise ConfigError("sampling needs the whole sequence on every rank: load the checkpoint without "
                              "context parallelism (mpi-tp generate)")
        logits_i = self.forward(idx, ps=ps)                                           # (1, S, V_i)
        last = backend.xp().ascontiguousarray(logits_i[:, -1, :])                     # (1, V_i)
        return backend.asnumpy(gather_from_tp(last, self.topo.tp, self.head.table.sizes))[0].astype(numpy.float64)

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
        if layers:                           # the blocks' aux and z-losses to the host in one copy
            xp = backend.xp()
            values = backend.asnumpy(xp.stack([xp.stack([xp.asarray(m["aux_loss"]), xp.asarray(m["z_loss"])])
                                               for m in layers]))
            for m, (aux, z) in zip(layers, values):
                m["aux_loss"], m["z_loss"] = float(aux), float(z)
        return {"cross_entropy": getattr(self, "_cross_entropy", None),
                "aux_loss": sum(m["aux_loss"] for m in layers), "z_loss": sum(m["z_loss"] for m in layers),
                "aux_weight": self.cfg.moe_aux_weight, "z_weight": self.cfg.moe_z_weight, "layers": layers}

    def unique_parameters(self) -> list:
        """Every parameter once over the whole model: a last chunk that is not first leaves out its copy of
        the tied table (its gradient equals the first stage's after finalize_grads)."""
        if self.last and not self.first and self.cfg.tied:
            return [p for p in self.parameters() if p is not self.head.table.weight]
        return self.parameters()

    def full_logits(self, idx):
        """Logits over the whole vocabulary (B, S, V) on every rank: for sampling and tests, not training."""
        return gather_from_tp(self.forward(idx), self.topo.tp, self.head.table.sizes)

    def num_params(self) -> int:
        """Parameters of the full model (not of this rank's shard; every expert, wherever it lives)."""
        moe = self.moe_layers()
        in_moe = {id(p) for m in moe for p in m.parameters()}
        return sum(int(numpy.prod(p.global_shape)) for p in self.parameters() if id(p) not in in_moe) + \
            sum(m.num_params() for m in moe)
