"""The serial reference of a run: the same model on one rank, started as the run was, and its step.

Every rank builds it (on MPI.COMM_SELF), so that each compares its own shards with the serial tensors
in memory: verify is for models small enough to be held once more per rank. The reference takes the
whole global batch as one micro-batch: the dropout masks are keyed by each sequence's row in the global
batch (mpi_tp.model.dropout), so they are the run's whatever its dp and micro-batches, and a bug in the
accumulation over micro-batches cannot be shared by the reference.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi_tp import checkpoint as ckpt_io
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.step import train_step


@dataclass
class Reference:
    model: GPT
    opt: object
    topo: Topology

    @property
    def params(self) -> dict:
        """name -> the serial Param."""
        return {p.name: p for p in self.model.parameters()}

    def step(self, x, y, lr: float, grad_clip: float, micro_batches: int = 1) -> tuple[float, float]:
        """One step on the whole global batch (x, y), in `micro_batches` equal parts: (loss, gradient norm)."""
        loss, norm, problem = train_step(self.model, self.opt, x, y, slice(0, x.shape[0]), micro_batches, lr,
                                         grad_clip)
        if problem is not None:
            raise FloatingPointError(f"the serial reference's step failed: {problem}")
        return loss, norm

    def free(self) -> None:
        self.topo.free()


def reference(run) -> Reference:
    """The serial model of `run` (a training.build.Run): its model configuration, dtype, seed, dropout and
    optimizer, started from the run's initial weights (the seed's, or --init-from's checkpoint)."""
    cfg = run.cfg
    topo = Topology.serial()
    model = GPT(run.model.cfg, topo, dtype=cfg.model_dtype, seed=cfg.seed)
    opt = cfg.make_optimizer(model.parameters())
    if cfg.init_from:
        with ckpt_io.open_checkpoint(cfg.init_from) as start:
            ckpt_io.load_into(start, model, opt)
            ckpt_io.restore_rng(start, model)
    return Reference(model, opt, topo)
