"""The model chunks of one pipeline stage, built from the GPT's pieces, and the stage that runs them.

    stage = build_stage(cfg, topo, schedule_name="1f1b", micro_batches=4)

Stage s of P holds global chunks s, s + P, ... (v of them with the interleaved
schedule; chunks s and 2P - 1 - s with zb-v), each a GPT over a contiguous run of blocks (layer_ranges), with the
embedding when it is the model's first chunk and the head when it is the last
(Megatron's pre_process and post_process). first_stage_layers / last_stage_layers set
how many blocks stage 0 / stage P - 1 holds (None: as layer_ranges splits them). The stage itself, which runs the
schedule and knows nothing of what a chunk computes, is
mpi_tp.parallel.pipeline.stage.PipelineStage.
"""
from __future__ import annotations

from mpi_tp.model.config import GPTConfig
from mpi_tp.model.dropout import Dropout
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.pipeline.actions import global_chunk
from mpi_tp.parallel.pipeline.schedules import V_SHAPED
from mpi_tp.parallel.pipeline.stage import PipelineStage
from mpi_tp.parallel.pipeline.stages import layer_ranges
from mpi_tp.parallel.topology import Topology


def stage_chunks(cfg: GPTConfig, topo: Topology, dtype="float32", seed: int = 0, sequence_parallel: bool = False,
                 virtual: int = 1, recompute: str = "none", v_shape: bool = False,
                 first_stage_layers: int | None = None, last_stage_layers: int | None = None) -> list[GPT]:
    """The chunks of stage topo.pp.rank, in local order (v_shape: placed in a V, zb-v)."""
    P, s = topo.pp.size, topo.pp.rank
    last = P * virtual - 1
    dropout = Dropout(cfg.dropout, seed)            # one state for the stage: its chunks draw one step's masks
    where = [global_chunk(s, j, P, v_shape) for j in range(virtual)]
    ranges = layer_ranges(cfg.n_layer, P, virtual, v_shape, first_stage_layers, last_stage_layers)[s]
    return [GPT(cfg, topo, dtype, seed, sequence_parallel, blocks=r, first=where[j] == 0,
                last=where[j] == last, recompute=recompute, dropout=dropout)
            for j, r in enumerate(ranges)]


def build_stage(cfg: GPTConfig, topo: Topology, dtype="float32", seed: int = 0, sequence_parallel: bool = False,
                schedule_name: str = "1f1b", micro_batches: int = 1, virtual: int = 1,
                recompute: str = "none", first_stage_layers: int | None = None,
                last_stage_layers: int | None = None) -> PipelineStage:
    """This rank's pipeline stage of the GPT: its chunks and the schedule that runs them."""
    chunks = stage_chunks(cfg, topo, dtype, seed, sequence_parallel, virtual, recompute, schedule_name in V_SHAPED,
                          first_stage_layers, last_stage_layers)
    return PipelineStage(chunks, topo, schedule_name, micro_batches)
