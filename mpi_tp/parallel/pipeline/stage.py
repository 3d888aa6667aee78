"""One pipeline stage of the GPT: the model chunks it holds, and a training step's forwards and backwards.

    stage = build_stage(cfg, topo, schedule_name="1f1b", micro_batches=4)   # mpi_tp.model.chunks
    loss = forward_backward(stage, x, y, rows)          # mpi_tp.training.step: gradients in stage.parameters()

Stage s of P holds chunks s, s + P, ... of the model (v per stage, the
interleaved schedule's virtual stages), each a GPT over a contiguous run of
blocks (mpi_tp.parallel.pipeline.stages), built by the model from the pieces
it owns (mpi_tp.model.chunks): the model's first chunk also holds the
embedding, its last chunk the head (final norm, a copy of the tied table
wte or, untied, the table lm_head, the loss). Nothing here knows what a chunk computes. The engine
(mpi_tp.parallel.pipeline.engine) runs the schedule; this class supplies what
runs at each action: a micro-batch's forward through a chunk (with that
micro-batch's dropout masks, its forward caches set aside until its backward)
and its backward; under a zero-bubble schedule (zb-h1, zb-v) the backward is
B, its weight gradients deferred (mpi_tp.core.weight_grads) to the W action
that runs them. Messages between stages: mpi_tp.parallel.pipeline.wire.

A model that is not cut into stages runs the same code as the one stage of
the "none" schedule (as_stage). After the schedule, the library step
(mpi_tp.training.step) calls finalize_grads (mpi_tp.parallel.finalize), which completes the
gradients: the sequence-parallel sums, the two copies of wte summed over the
stages that hold them (mpi_tp.parallel.pipeline.embedding_group), the
data-parallel buckets. With a data_parallel.GradReducer, a chunk's block
gradients are final after the chunk's last backward in the stage's action
list; during that backward each block is reported to the reducer, which
starts every bucket whose blocks are all done, so it runs behind the rest of
the schedule.

Mixture of experts: every stage's MoE blocks add their aux and z-losses to the
loss; the loss of the step is the sum over stages (an all-reduce over pp, where
a dense model's other stages add 0), and each block's backward adds its terms'
gradient times 1 / M, the micro-batch's share of the loss.
"""
from __future__ import annotations

import numpy

from mpi_tp.core.failpoints import planted
from mpi_tp.core.weight_grads import WeightWork, deferring
from mpi_tp.parallel.pipeline.embedding_group import TiedEmbedding
from mpi_tp.parallel.pipeline.engine import PipelineEngine
from mpi_tp.parallel.pipeline.schedules import SPLIT, V_SHAPED, schedule
from mpi_tp.parallel.pipeline.wire import wire_format
from mpi_tp.parallel.topology import Topology


def micro_batch_rows(rows: slice, micro_batches: int) -> list[slice]:
    """A replica's rows of the global batch cut into equal micro-batches, in order (the same cut
    with a pipeline and without one, so the dropout masks, keyed by row, agree)."""
    n = rows.stop - rows.start
    if n % micro_batches:
        raise ValueError(f"{n} sequences do not split into {micro_batches} equal micro-batches")
    B = n // micro_batches                                       # sequences per micro-batch
    return [slice(rows.start + m * B, rows.start + (m + 1) * B) for m in range(micro_batches)]


class PipelineStage:
    """This rank's stage: `chunks` (GPT chunks, in local order) and the step that runs the schedule.

    count_activations: measure the bytes of activations held for backward passes still to come
    (peak_activation_bytes, over the last step); off by default, a walk over the caches per action.
    """

    count_activations = False

    def __init__(self, chunks: list, topo: Topology, schedule_name: str = "1f1b", micro_batches: int = 1):
        P, s, v = topo.pp.size, topo.pp.rank, len(chunks)
        self.schedule_name = schedule_name
        self.split = schedule_name in SPLIT             # backward cut into B and W (zero-bubble schedules)
        self.chunks, self.cfg, self.topo, self.M, self.v = chunks, chunks[0].cfg, topo, micro_batches, v
        self.h = [b for c in self.chunks for b in c.h]                   # every block of this stage
        self.block_offsets = [sum(len(c.h) for c in self.chunks[:j]) for j in range(v)]   # chunk j's in h
        self.dtype = self.chunks[0].dtype
        self.engine = PipelineEngine(topo.pp, schedule(schedule_name, P, micro_batches, v)[s], v,
                                     v_shape=schedule_name in V_SHAPED)
        tables = [c.embedding.wte for c in self.chunks if c.first]            # copies of wte on this rank
        tables += [c.head.table for c in self.chunks if c.last and not c.first]
        if not self.cfg.tied:                          # untied (llama's lm_head): nothing to sum
            tables = []
        self.tied_embedding = TiedEmbedding(tables, topo.pp, topo.stats)

    def parameters(self) -> list:
        return [p for c in self.chunks for p in c.parameters()]

    @property
    def dropout(self):
        """The dropout state (seed, step) of the stage: one object, shared by its chunks (model.chunks)."""
        return self.chunks[0].dropout

    def num_params(self) -> int:
        """Parameters of the whole model (every stage's, the tied table once)."""
        mine = sum(int(numpy.prod(p.global_shape)) for p in self.unique_parameters())
        return self.topo.pp.comm.allreduce(mine)            # a few bytes, once

    def eval(self) -> PipelineStage:
        return self.train(False)

    def unique_parameters(self) -> list:
        """Every parameter once over the whole pipeline: the output layer's copy of wte left out."""
        return [p for c in self.chunks for p in c.unique_parameters()]

    def buffers(self) -> list:
        """Every Buffer of this stage's chunks (the MoE blocks' expert biases)."""
        return [b for c in self.chunks for b in c.buffers()]

    def moe_layers(self) -> list:
        """The MoEMLP of every MoE block of this stage, in order."""
        return [m for c in self.chunks for m in c.moe_layers()]

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad()

    def train(self, mode: bool = True) -> PipelineStage:
        for c in self.chunks:
            c.train(mode)
        return self

    def _wire(self, B: int, ps):
        """The wire format of a micro-batch of B sequences with pass ps: under context parallelism this
        rank's S_r positions travel, under sequence parallelism its S_i of them."""
        return wire_format(self.topo, ps.sp, B, ps.local, self.cfg.n_embd)

    def _forward_only(self, x, y=None):
        """x (B, S) through every stage, one micro-batch: the loss (y given) or the last position's
        whole-vocabulary logits (V,), on every rank of the pipeline."""
        ps, out = self.chunks[0].new_pass(x.shape[1]), {}
        shape, to_wire, from_wire = self._wire(x.shape[0], ps)

        def forward(m, j, inp):
            chunk = self.chunks[j]
            inp = x if chunk.first else from_wire(inp)
            if chunk.last:
                out["value"] = out.get("value", 0.0) + (chunk.forward(inp, y, ps) if y is not None
                                                        else chunk.last_logits(inp, ps))
                result = None
            else:
                result = to_wire(chunk.forward(inp, ps=ps))
                if y is not None:
                    out["value"] = out.get("value", 0.0) + chunk.moe_loss()     # MoE blocks' terms
            chunk.stash_caches()                                # no backward follows: drop the caches
            return result

        self.engine.run(forward, None, shape, self.dtype, actions=self.engine.forward_only(1))
        V = self.cfg.vocab_size
        value = numpy.zeros(1 if y is not None else V)
        if "value" in out:
            value[...] = out["value"]
        if y is not None:
            self.topo.pp.all_reduce(value)                      # the loss: every stage's part
        else:
            self.topo.pp.broadcast(value, root=self.topo.pp.size - 1)
        return float(value[0]) if y is not None else value

    def forward(self, x, y):
        """The loss of batch (x, y), every stage taking part (evaluation: no dropout in eval mode)."""
        return self._forward_only(x, y)

    def last_logits(self, idx):
        """As GPT.last_logits: the last position's logits over the whole vocabulary, (V,) on every rank."""
        return self._forward_only(idx)

    def run_micro_batches(self, x, y, parts: list[slice], reducer=None, meter=None, loss_scale=1.0) -> list[float]:
        """Run the schedule over the micro-batches `parts` (rows of the global batch x, y): each one's
        forward through every chunk and its backward, gradients accumulated (scaled by loss_scale / M:
        gradient accumulation, and fp16's loss scaling, mpi_tp.training.loss_scale). Returns
        each micro-batch's loss on this stage (the last stage's cross-entropy, every stage's MoE terms);
        the library step (mpi_tp.training.step) zeroes the gradients first and completes them after.

        meter: a training.progress.MoEMeter, given each chunk's MoE statistics per micro-batch.
        reducer: a data_parallel.GradReducer over this stage's parameters: told of each chunk's
        blocks during the chunk's last backward, or its last W where the backward is cut (their
        gradients are final then).
        """
        M, S = self.M, x.shape[1]
        if len(parts) != M:
            raise ValueError(f"this stage's schedule runs {M} micro-batches, not {len(parts)}")
        passes = [self.chunks[0].new_pass(S, rows.start) for rows in parts]     # each micro-batch's, once
        shape, to_wire, from_wire = self._wire(parts[0].stop - parts[0].start, passes[0])
        losses, held = [0.0] * M, {}
        kept = self.stashed = {}           # (m, j): its caches set aside until its backward (core.memory reads)
        deferred = self.deferred = {}      # (m, j): its W, the weight gradients its B deferred (core.memory reads)
        self.weight_calls = 0              # deferred weight-gradient calls run by W actions this step
        live = self.peak_activation_bytes = 0          # activations kept for backward passes, this stage
        closes = "W" if self.split else "B"            # the action after which a chunk's gradients are final
        final = {a.chunk: a.micro for a in self.engine.actions if a.kind == closes}   # each chunk's last one

        def forward(m, j, inp):
            nonlocal live
            chunk = self.chunks[j]
            inp = x[parts[m]] if chunk.first else from_wire(inp)
            out = chunk.forward(inp, y[parts[m]] if chunk.last else None, passes[m])
            if not chunk.last:
                losses[m] += chunk.moe_loss()                                  # its MoE blocks' terms
            if meter is not None:                                             # (MoE: training's metrics)
                meter.add(chunk, 1.0 / M)
            if self.count_activations:
                held[m, j] = chunk.activation_bytes()
                live += held[m, j]
                self.peak_activation_bytes = max(self.peak_activation_bytes, live)
            kept[m, j] = chunk.stash_caches()
            if chunk.last:
                losses[m] += out
                return None
            return to_wire(out)

        def backward(m, j, dout):
            nonlocal live
            chunk = self.chunks[j]
            chunk.restore_caches(kept.pop((m, j)))
            live -= held.pop((m, j), 0)
            hook = reducer.chunk(self.block_offsets[j]) if reducer is not None and m == final[j] else None
            grads = reducer.grads(self.block_offsets[j]) if reducer is not None else None     # ZeRO-2
            share = loss_scale if planted("bug-micro-batch-scale") else loss_scale / M      # the 1/M of accumulation
            dout = share if chunk.last else from_wire(dout)
            if not self.split:
                dx = chunk.backward(dout, reducer=hook, loss_scale=share, grads=grads)
            else:                                   # B now; the weights' gradients (and the hook) at W
                with deferring(WeightWork()) as work:
                    dx = chunk.backward(dout, reducer=hook, loss_scale=share, grads=grads)
                deferred[m, j] = work
                if self.count_activations:          # what W keeps alive until it runs
                    held[m, j] = work.held_bytes()
                    live += held[m, j]
                    self.peak_activation_bytes = max(self.peak_activation_bytes, live)
            return None if chunk.first else to_wire(dx)

        def weights(m, j):
            nonlocal live
            work = deferred.pop((m, j))
            self.weight_calls += len(work)
            work.run()
            live -= held.pop((m, j), 0)

        self.engine.run(forward, backward, shape, self.dtype, weights=weights)
        if self.dropout.training:
            self.dropout.advance()                      # the next step draws fresh masks
        return losses


def as_stage(model, micro_batches: int | None = None) -> PipelineStage:
    """What the library step runs: a PipelineStage itself, or a GPT (a model not cut into stages) as the
    one stage of the "none" schedule, made once per micro-batch count and kept on the model."""
    if isinstance(model, PipelineStage):
        if micro_batches not in (None, model.M):
            raise ValueError(f"this pipeline stage was built for {model.M} micro-batches, not {micro_batches}")
        return model
    M = micro_batches or 1
    stages = model.__dict__.setdefault("_as_stage", {})
    if M not in stages:
        stages[M] = PipelineStage([model], model.topo, "none", M)
    return stages[M]
