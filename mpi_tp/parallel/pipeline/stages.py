"""Which transformer blocks each pipeline stage holds: contiguous runs, remainders at the front.

The model's blocks are cut into P * v chunks (P stages, v chunks per stage for
the interleaved schedule and zb-v), in model order; rank s holds chunks s, s + P, ...,
or under zb-v chunks s and 2P - 1 - s (see actions.global_chunk). Layer counts need not divide: the chunks differ
by at most one block, and the chunks that get the extra block are the first
ones, the split rule of the tensor-parallel shards (split_sizes).

    layer_ranges(3, stages=2)            [[range(0, 2)], [range(2, 3)]]
    layer_ranges(70, stages=12)          ten stages of 6 blocks, then two of 5

Why the front: the last stage also runs the final LayerNorm, the tied output
layer (a V x C product per token, V / (12 C) of a block's work: about a third
of a block at GPT-3's sizes) and the loss, and the first stage only looks up
embeddings, so a stage at the end is the one that can least afford a block
more. (Under 1F1B the first stage also keeps the most micro-batches' activations,
P of them, so when memory rather than time is what binds, the opposite choice is
defensible; the cost model prices the largest stage as the pace-setter either way.)
"""
from __future__ import annotations

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.pipeline.actions import global_chunk
from mpi_tp.parallel.topology import offsets, split_sizes


def layer_ranges(n_layer: int, stages: int, virtual: int = 1, v_shape: bool = False) -> list[list[range]]:
    """[stage][local chunk] -> the range of block indices it holds (v_shape: the V placement, zb-v)."""
    chunks = stages * virtual
    if n_layer < chunks:
        raise UserError(f"{n_layer} layers cannot fill {stages} pipeline stages x {virtual} chunks: every chunk "
                        f"needs a block; use at most {n_layer} stages x chunks")
    sizes = split_sizes(n_layer, chunks)
    starts = offsets(sizes)
    where = [[global_chunk(s, c, stages, v_shape) for c in range(virtual)] for s in range(stages)]
    return [[range(starts[g], starts[g] + sizes[g]) for g in gs] for gs in where]
