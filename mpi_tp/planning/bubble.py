"""The pipeline's bubble and hops under each schedule the cost model prices, in closed form.

P stages, v chunks per stage, M micro-batches per step; a stage's work for one micro-batch is
t_F + t_B + t_W: the forward, B (the backward's input gradients: the dX GEMMs, attention's
backward, the elementwise backward, the recomputed forward) and W (the weights' gradients: the dW
GEMMs alone, deferrable). w = t_W / (t_F + t_B + t_W) is W's share of the work.

    schedule       idle per stage and step             as a fraction of the step's work M (t_F + t_B + t_W)
    1f1b           (P - 1) (t_F + t_B + t_W)           (P - 1) / M
    interleaved    (P - 1) (t_F + t_B + t_W) / v       (P - 1) / (v M)
    zb-h1          (P - 1) (t_F + t_B - t_W)           (P - 1) (1 - 2w) / M        = (P - 1) / (3M) at w = 1/3
    zb-v           (P - 1) (t_F + t_B - 2 t_W) / 2     (P - 1) (1 - 3w) / (2M)     = 0 at w = 1/3

Qi et al. 2024 (Zero Bubble Pipeline Parallelism, arXiv 2401.10241), section 2: 1F1B idles
(p - 1)(T_F + T_B + T_W); ZB-H1 starts each B as soon as its successor's B arrives and holds the
W passes back to fill the drain, leaving (p - 1)(T_F + T_B - T_W), a third of 1F1B's at
T_F = T_B = T_W, at 1F1B's peak activation memory; ZB-H2 fills the warm-up too, (p - 1)(T_F + T_B
- 2 T_W), at more memory. ZB-V (their V-shaped schedule: rank s holds chunks s and 2P-1-s) reaches
ZB-H2's bubble at 1F1B's memory on chunks of half a stage, hence the / 2. A negative idle is
none (a W longer than F + B: never under this code's split, where t_W <= t_B). These are the
paper's steady-state figures: with fewer micro-batches than stages there are too few W passes
to fill the drain, so the planner offers the zero-bubble schedules only where M >= P.

Messages: a micro-batch's forward crosses P v - 1 chunk boundaries (the same again backward);
in the V, chunks P - 1 and P sit on rank P - 1, so 2 (P - 1): twice 1F1B's traffic.
"""
from __future__ import annotations

import functools

from mpi_tp.parallel.pipeline.stages import layer_ranges

ZERO_BUBBLE = ("zb-h1", "zb-v")       # the schedule names mpi_tp.parallel.pipeline.schedules runs


def bubble_fraction(schedule: str | None, p: int, v: int, micro: float, w_share: float,
                    chunks: list | None = None) -> float:
    """Idle time per stage over the step's work (the table above); schedule None: 1F1B, or
    interleaved at v > 1. With `chunks` (blocks_by_stage: each stage's chunks' blocks) the largest chunk sets
    the pace where they differ, so 1 / v becomes its share of the largest stage (126 blocks on 16 stages:
    v = 5, 6 and 7 idle as v = 4 does, chunks of 2 blocks against stages of 8)."""
    if p <= 1:
        return 0.0
    share = 1 / (2 if schedule == "zb-v" else v)
    if chunks:
        share = max(max(c) for c in chunks) / max(sum(c) for c in chunks)
    if schedule == "zb-h1":
        return (p - 1) * max(0.0, 1 - 2 * w_share) / micro
    if schedule == "zb-v":
        return (p - 1) * max(0.0, 1 - 3 * w_share) * share / micro
    return (p - 1) * share / micro


def blocks_by_stage(n_layer: int, lay) -> tuple:
    """[stage][local chunk] -> its blocks, as the engine cuts the model (mpi_tp.parallel.pipeline.stages: chunks
    differing by a block, the extra ones first, or the end stages' blocks set: Plan.first_stage_layers and
    last_stage_layers; one stage: all of them)."""
    return _blocks(n_layer, lay.pp, lay.virtual, lay.schedule == "zb-v", lay.first_stage_layers or None,
                   lay.last_stage_layers or None)


@functools.lru_cache(maxsize=4096)
def _blocks(n_layer: int, pp: int, virtual: int, v_shape: bool, first: int | None, last: int | None) -> tuple:
    """blocks_by_stage's cut, once per shape (a search prices thousands of layouts on a few cuts)."""
    return tuple(tuple(len(r) for r in stage) for stage in layer_ranges(n_layer, pp, virtual, v_shape, first, last))


def forward_hops(schedule: str | None, p: int, v: int) -> int:
    """Chunk boundaries one micro-batch's forward crosses between ranks (as many again backward)."""
    return 2 * (p - 1) if schedule == "zb-v" else p * v - 1
