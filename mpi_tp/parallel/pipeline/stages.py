"""Which transformer blocks each pipeline stage holds: contiguous runs, remainders at the front.

The model's blocks are cut into P * v chunks (P stages, v chunks per stage for
the interleaved schedule and zb-v), in model order; rank s holds chunks s, s + P, ...,
or under zb-v chunks s and 2P - 1 - s (see actions.global_chunk). Layer counts need not divide: the chunks differ
by at most one block, and the chunks that get the extra block are the first
ones, the split rule of the tensor-parallel shards (split_sizes).

    layer_ranges(3, stages=2)                     [[range(0, 2)], [range(2, 3)]]
    layer_ranges(70, stages=12)                   ten stages of 6 blocks, then two of 5
    layer_ranges(10, stages=4, first=1, last=1)   stages of 1, 4, 4 and 1 blocks

Why the front: the last stage also runs the final LayerNorm, the tied output
layer (a V x C product per token, V / (12 C) of a block's work: about a third
of a block at GPT-3's sizes) and the loss, and the first stage only looks up
embeddings, so a stage at the end is the one that can least afford a block
more. (Under 1F1B the first stage also keeps the most micro-batches' activations,
P of them, so when memory rather than time is what binds, the opposite choice is
defensible; the cost model prices the largest stage as the pace-setter either way.)

The ends set by hand (first, last): Megatron-Core's --decoder-first-pipeline-num-layers
and --decoder-last-pipeline-num-layers. Llama 3 (arXiv 2407.21783, section 3.3.2)
gives its first and last stages one block fewer than the others: the first keeps
the most activations in flight, the last runs the output layer and the loss. The
stages between share what is left as above (split_sizes, remainders at the front),
and each stage cuts its own blocks over its v chunks the same way, in its chunk order.
"""
from __future__ import annotations

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.pipeline.actions import global_chunk
from mpi_tp.parallel.topology import offsets, split_sizes


def stage_blocks(n_layer: int, stages: int, virtual: int = 1, first: int | None = None,
                 last: int | None = None) -> list[int]:
    """How many blocks each stage holds when the first and/or last stage's count is set (None: that
    stage shares the rest with the stages between, split_sizes in stage order). UserError, saying which
    count to change, when a stage would hold fewer blocks than its v chunks."""
    if stages < 2:
        raise UserError(f"first={first} / last={last} blocks on the pipeline's end stages need at least 2 "
                        f"stages, got {stages}")
    fixed = {0: first, stages - 1: last}
    for s, n in fixed.items():
        if n is not None and n < virtual:
            end = "first" if s == 0 else "last"
            raise UserError(f"the {end} stage's {n} blocks cannot fill its {virtual} chunk(s): every chunk "
                            f"needs a block; give it at least {virtual}")
    shared = [s for s in range(stages) if fixed.get(s) is None]          # the stages that share the rest
    rest = n_layer - sum(n for n in fixed.values() if n is not None)
    if rest < len(shared) * virtual or (not shared and rest != 0):
        need = (f"exactly {n_layer}" if not shared else
                f"at most {n_layer - len(shared) * virtual}, leaving a block for each of the other "
                f"{len(shared)} stage(s) x {virtual} chunk(s)")
        raise UserError(f"{n_layer} layers with first={first} and last={last} blocks on the end stages: "
                        f"the ends' blocks must add up to {need}")
    sizes = dict(zip(shared, split_sizes(rest, len(shared)) if shared else []))
    return [sizes[s] if fixed.get(s) is None else fixed[s] for s in range(stages)]


def layer_ranges(n_layer: int, stages: int, virtual: int = 1, v_shape: bool = False, first: int | None = None,
                 last: int | None = None) -> list[list[range]]:
    """[stage][local chunk] -> the range of block indices it holds (v_shape: the V placement, zb-v).

    first / last: how many blocks rank 0 / rank P - 1 holds in all, over its v chunks, whichever chunks
    of the model those are (under zb-v rank 0 holds the model's first and last chunks, 0 and 2P - 1, and
    rank P - 1 the two in the middle, P - 1 and P); None: the rule of the module docstring. Blocks stay
    in model order: global chunk g holds blocks before chunk g + 1's."""
    chunks = stages * virtual
    if n_layer < chunks:
        raise UserError(f"{n_layer} layers cannot fill {stages} pipeline stages x {virtual} chunks: every chunk "
                        f"needs a block; use at most {n_layer} stages x chunks")
    where = [[global_chunk(s, c, stages, v_shape) for c in range(virtual)] for s in range(stages)]
    if first is None and last is None:
        sizes = split_sizes(n_layer, chunks)
    else:
        sizes = [0] * chunks
        for s, n in enumerate(stage_blocks(n_layer, stages, virtual, first, last)):
            for g, size in zip(where[s], split_sizes(n, virtual)):        # the stage's chunks, in its order
                sizes[g] = size
    starts = offsets(sizes)
    return [[range(starts[g], starts[g] + sizes[g]) for g in gs] for gs in where]
