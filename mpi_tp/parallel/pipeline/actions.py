"""What a pipeline schedule is made of: actions, and where each model chunk sits.

An action is (kind, micro-batch, chunk): kind "F" (forward) or "B" (backward)
of one micro-batch through one model chunk that the stage holds, or, in the
zero-bubble schedules, "W": the weights' gradients of a backward that ran
earlier (mpi_tp.core.weight_grads). With v chunks per rank, P ranks hold P v
chunks in model order ("global chunks"), placed in one of two ways:

    loop   rank s holds chunks s, s + P, s + 2P, ... (Megatron's interleaved placement; v = 1: chunk s)
    V      rank s holds chunks s and 2P - 1 - s (v = 2, zb-v): down the ranks and back up, so the
           model's first and last chunks sit on rank 0 and chunks P - 1 and P on rank P - 1, which
           hands its own output to itself
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str           # "F", "B" or "W"
    micro: int          # micro-batch index, 0 .. M - 1
    chunk: int = 0      # this rank's model chunk, 0 .. v - 1

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def global_chunk(stage: int, chunk: int, stages: int, v_shape: bool = False) -> int:
    """The position in the model of rank `stage`'s local chunk (loop placement, or the V's)."""
    if v_shape:
        return stage if chunk == 0 else 2 * stages - 1 - stage
    return chunk * stages + stage


def chunk_owner(g: int, stages: int, v_shape: bool = False) -> int:
    """The rank holding global chunk g."""
    if v_shape:
        return g if g < stages else 2 * stages - 1 - g
    return g % stages
