"""A pass: one micro-batch's forward, the facts every layer reads, built once by whoever starts it.

    ps = model.new_pass(S, row0=4)              # GPT.new_pass: this layout's cut, this step's masks
    loss = model.forward(x, y, ps)              # every layer of every chunk reads the same ps

What a micro-batch's layers need to know besides their weights and inputs:
    S       the sequence length (whole: every rank's positions together)
    cp      context parallelism's cut of the sequence over topo.cp (ContextSplit: each rank's
            two chunks, their global positions), or None
    sp      sequence parallelism's cut of this rank's positions over topo.tp (SequenceSplit), or None
    masks   the dropout masks' key (model.dropout.Masks: seed, step, the batch's first row in the
            step's global batch), or None (evaluation, inference, a zero dropout probability)
    row0    the micro-batch's first row in the step's global batch (which sequences these are:
            mpi_tp.verify finds a layer's serial counterpart by it)
A GPT called without a pass starts its own (GPT.forward); a pipeline stage starts one per
micro-batch and hands it to every chunk (mpi_tp.parallel.pipeline.stage); cached decoding calls
the layers with none (NO_PASS: nothing cut, no dropout). A pass is frozen, so activation
recomputation keeps it and replays the same forward (mpi_tp.model.block).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mpi_tp.model.dropout import Masks
from mpi_tp.parallel.context_parallel import ContextSplit
from mpi_tp.parallel.sequence_parallel import SequenceSplit


@dataclass(frozen=True)
class Pass:
    S: int
    cp: ContextSplit | None = None
    sp: SequenceSplit | None = None
    masks: Masks | None = None
    row0: int = 0

    @classmethod
    def start(cls, topo, S: int, sequence_parallel: bool = False, masks: Masks | None = None,
              overlap: bool | None = None, row0: int = 0) -> Pass:
        """The pass of a micro-batch of sequences of S positions on this rank of `topo` whose first is row
        row0 of the step's global batch (overlap: the SequenceSplit's, None for its default)."""
        cp = ContextSplit(topo.cp, S) if topo.cp.size > 1 else None
        ps = cls(S, cp, None, masks, row0)
        return replace(ps, sp=SequenceSplit(topo.tp, ps.local, overlap)) if sequence_parallel else ps

    @property
    def local(self) -> int:
        """This rank's positions before sequence parallelism cuts them: S, or its context-parallel share."""
        return self.S if self.cp is None else self.cp.length()

    @property
    def scale(self) -> float:
        """The kept activations' factor 1 / (1 - p); 1 without dropout."""
        return 1.0 if self.masks is None else self.masks.scale


NO_PASS = Pass(0)        # cached decoding's layers: nothing cut, no dropout
