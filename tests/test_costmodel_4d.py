"""The cost model's terms for today's 4-D runs (issue 43), each against what it prices: the interleaved schedule at
every v (the engine's own schedule played and counted), the end stages set by hand (the engine's split),
FlashAttention's rate by block size, Transformer Engine's overlapped tensor-parallel collectives and Megatron's ZeRO-1 memory (by
hand)."""
import math

import pytest

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.pipeline.schedules import in_flight, interleaved, simulate
from mpi_tp.parallel.pipeline.stages import layer_ranges
from mpi_tp.parallel.topology import split_sizes
from mpi_tp.planning import attention_cost as attn
from mpi_tp.planning.bubble import blocks_by_stage, bubble_fraction
from mpi_tp.planning.costmodel import TP_OVERLAP_SPLITS, Plan, step_time
from mpi_tp.planning.machines import PRESETS, Machine, curve_rate
from mpi_tp.planning.memory import interleaved_activations, memory_per_rank, stage_activations, state_per_rank
from mpi_tp.planning.planner import candidates, chunk_counts, plan, price
from mpi_tp.planning.workload import Workload


def test_interleaved_memory_is_the_schedules_warm_up():
    """A stage's held blocks = the engine's interleaved schedule's most chunks in flight (schedules.in_flight),
    each weighed by its blocks as stages.layer_ranges cuts them: first and last stage, even and uneven chunks."""
    for L, P, v, M in ((16, 4, 2, 4), (126, 16, 7, 16), (80, 4, 5, 8), (10, 2, 3, 2), (24, 4, 2, 12)):
        acts = interleaved(P, M, v)
        ranges = layer_ranges(L, P, v)
        for s in (0, P - 1):
            most = in_flight(acts[s])
            forwards = [a for a in acts[s] if a.kind == "F"][:most]            # the warm-up and the one in flight
            blocks = sum(len(ranges[s][a.chunk]) for a in forwards)
            got = interleaved_activations([[len(r) for r in st] for st in ranges], M, 1.0, 0.0, 0.0)
            if s == 0:
                assert got == (blocks, 0.0), (L, P, v, M, got, blocks)
            else:
                assert blocks <= got[0], (L, P, v, M)
    # in bytes: stage 0 of 8 layers on 2 stages, v 2, M 4 holds min(2 + 2 + 1, 8) = 5 chunks of 2 blocks
    assert interleaved_activations([[2, 2], [2, 2]], 4, 3.0, 0.0, 0.0) == (5 * 2 * 3.0, 0.0)
    # P + (P - 1) / v stages' worth when M is large: P = 4, v = 2: 5.5 stages of 8 blocks, 44 blocks
    assert interleaved_activations([[4, 4]] * 4, 64, 1.0, 0.0, 0.0)[0] == (2 * 3 + 4 + 1) * 4


def test_interleaved_stage_memory_in_the_plan():
    """memory.stage_activations under the interleaved schedule is interleaved_activations: more than 1F1B's P
    micro-batches, by (P - 1) / v of a stage."""
    m = PRESETS["dgx-a100"]
    w = Workload(n_layer=32, n_embd=1024, n_head=16, seq=1024, global_batch=64)
    one = stage_activations(m, w, Plan(tp=2, pp=4, dp=1, micro_batch=1))[0]
    two = stage_activations(m, w, Plan(tp=2, pp=4, dp=1, micro_batch=1, virtual=2))[0]
    assert two == pytest.approx(one * (4 + 3 / 2) / 4)


def test_uneven_chunks_idle_as_the_largest():
    """With L / (P v) not whole the largest chunk sets the pace: bubble_fraction with the layers = (P - 1) / M x
    ceil(L / (P v)) / ceil(L / P); the engine's schedule played at each chunk's blocks (schedules.simulate) idles
    within 10% of it at even stages, and v 5, 6 and 7 of 126 blocks on 16 stages no less than v 4."""
    for L, P, v, M in ((126, 16, 4, 16), (126, 16, 7, 16), (128, 8, 4, 16), (80, 4, 5, 8), (80, 4, 3, 8)):
        sizes = split_sizes(L, P * v)
        played = simulate(interleaved(P, M, v), 1.0, 2.0, None, sizes=sizes)["bubble"]
        formula = bubble_fraction(None, P, v, M, 0.3, blocks_by_stage(L, Plan(pp=P, virtual=v)))
        assert formula == pytest.approx((P - 1) / M * math.ceil(L / (P * v)) / math.ceil(L / P))
        if L % P == 0:
            assert formula == pytest.approx(played, rel=0.1), (L, P, v, M, formula, played)
    assert bubble_fraction(None, 16, 4, 16, 0.3, blocks_by_stage(126, Plan(pp=16, virtual=4))) == \
        bubble_fraction(None, 16, 7, 16, 0.3, blocks_by_stage(126, Plan(pp=16, virtual=7)))
    for v in (5, 6, 7):
        sizes = split_sizes(126, 16 * v)
        assert simulate(interleaved(16, 16, v), 1.0, 2.0, None, sizes=sizes)["bubble"] >= \
            simulate(interleaved(16, 16, 4), 1.0, 2.0, None, sizes=split_sizes(126, 64))["bubble"]
    assert bubble_fraction(None, 4, 2, 8, 0.3) == 3 / 16                      # without the layers: 1 / v


def test_the_search_tries_each_chunk_size_once():
    """chunk_counts: the fewest chunks for every chunk size, so no v left out idles less; the planner's best
    interleaved layout over those equals its best over every v."""
    for L, P in ((126, 16), (80, 4), (128, 2), (24, 2), (7, 3)):
        every = list(range(2, L // P + 1))
        kept = chunk_counts(L, P)
        assert kept == sorted(set(kept)) and all(v >= 2 for v in kept) and len(kept) <= len(every) + 1
        for v in every:                      # each v's chunk size is reached by a kept v no larger
            assert any(u <= v and math.ceil(L / (P * u)) == math.ceil(L / (P * v)) for u in kept), (L, P, v)
    m, w = PRESETS["dgx-a100"], Workload(n_layer=24, n_embd=2048, n_head=16, seq=1024, global_batch=64)
    searched = plan(m, w, 1, top=1, tp=2, pp=2, micro_only=4, schedules=("interleaved",))["ranked"][0]
    by_hand = min(step_time(m, w, Plan(tp=2, pp=2, dp=2, micro_batch=4, virtual=v, sp=sp, zero=z,
                                        recompute=r))["total"]
                   for v in range(2, 13) for sp in (False, True) for z in (0, 1, 2, 3) for r in (False, True))
    assert searched["time"]["total"] == pytest.approx(by_hand)
    assert {x.virtual for x in candidates(w, 8, 8, tp_only=2, pp_only=2, micro_only=4, schedules=("interleaved",))} \
        == set(chunk_counts(24, 2))


def test_flash_rate_by_block_size():
    """FlashAttention's rate read off the machine's curve at a rank's query positions (a ring step's block at cp):
    interpolated in log(positions) between the points, flat beyond; dgx-h100's points are the forward and
    backward of Shah et al. 2024 combined as 3.5 / (1 / fwd + 2.5 / bwd); a ring of small blocks computes slower."""
    m = PRESETS["dgx-h100"]
    fwd = {512: 191, 1024: 260, 2048: 298, 4096: 319, 8192: 333, 16384: 335}
    bwd = {512: 214, 1024: 260, 2048: 291, 4096: 310, 8192: 318, 16384: 322}
    for s, f in m.flash_curve:
        assert f / 1e12 == pytest.approx(3.5 / (1 / fwd[s] + 2.5 / bwd[s]), abs=0.6), s
    assert m.flash_flops == m.flash_curve[-1][1]
    w = Workload(n_layer=8, n_embd=4096, n_head=32, seq=131072, global_batch=8, attention="flash")
    assert attn.score_rate(m, w, 8192, 6e14) == 322e12 and attn.score_rate(m, w, 131072, 6e14) == 326e12
    x = math.log(1536 / 1024) / math.log(2)
    assert attn.score_rate(m, w, 1536, 6e14) == pytest.approx(260e12 + x * (293e12 - 260e12))
    assert attn.score_rate(m, w, 256, 6e14) == 207e12
    assert curve_rate([], 100, 5.0) == 5.0
    stored = Workload(n_layer=8, n_embd=4096, n_head=32, seq=2048, global_batch=8, attention="stored")
    assert attn.score_rate(m, stored, 2048, 6e14) == 6e14                    # the GEMM rate, not flash's
    # the same positions, split 16 or 128 ways: each rank's score FLOPs / 8, its rate from 322 to 260 TFLOP/s
    t16 = step_time(m, w, Plan(cp=16, dp=1, micro_batch=1))
    t128 = step_time(m, w, Plan(cp=128, dp=1, micro_batch=1))
    assert t128["compute"] > t16["compute"] / 8


def test_a_machine_file_s_flash_curve_is_checked(tmp_path):
    import json
    data = {"name": "x", "ranks_per_node": 1, "gemm_flops": 1e9, "elem_rate": 1e9, "mem_bw": 1e9, "mem_bytes": 1e9,
            "intra_alpha": 0, "intra_bw": 1e9, "inter_alpha": 0, "inter_bw": 1e9, "flash_curve": [[512, -1]]}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="flash_curve must be"):
        Machine.load(str(path))


def test_end_stages_set_by_hand():
    """first_stage_layers / last_stage_layers priced as the engine cuts the model (stages.layer_ranges): the pace
    is the largest stage's blocks, the first stage's activations its own blocks'; the planner offers the ends a
    block lighter only where two stages come short anyway (126 blocks on 16 stages: 7 + 14 x 8 + 7, the same pace
    as 14 x 8 + 2 x 7), and `plan --explain` reads and `--emit-config` writes them."""
    m = PRESETS["dgx-h100"]
    w = Workload(n_layer=126, n_embd=4096, n_head=32, seq=4096, global_batch=64, arch="llama", n_kv_head=8,
                 intermediate_size=14336, attention="flash")
    plain, ends = Plan(tp=8, pp=16, dp=1, micro_batch=1), Plan(tp=8, pp=16, dp=1, micro_batch=1,
                                                               first_stage_layers=7, last_stage_layers=7)
    assert blocks_by_stage(126, plain) == ((8,),) * 14 + ((7,),) * 2
    assert blocks_by_stage(126, ends) == ((7,),) + ((8,),) * 14 + ((7,),)
    assert step_time(m, w, ends)["total"] == step_time(m, w, plain)["total"]          # the same pace
    a = stage_activations(m, w, plain)[0]
    assert stage_activations(m, w, ends)[0] == pytest.approx(a * 7 / 8)                # the first stage: 7 of 8
    heavy = Plan(tp=8, pp=16, dp=1, micro_batch=1, first_stage_layers=2, last_stage_layers=2)   # 122 on 14: 9
    assert step_time(m, w, heavy)["compute"] == pytest.approx(step_time(m, w, plain)["compute"] * 9 / 8, rel=1e-3)
    offered = {(x.first_stage_layers, x.last_stage_layers) for x in candidates(w, 128, 8, tp_only=8, pp_only=16,
                                                                                 micro_only=1)}
    assert offered == {(0, 0), (7, 7)}
    assert {(x.first_stage_layers, x.last_stage_layers) for x in candidates(
        Workload(n_layer=128, n_embd=4096, n_head=32, seq=4096, global_batch=64), 128, 8, tp_only=8, pp_only=16,
        micro_only=1)} == {(0, 0)}                                                     # 128 on 16: none short
    from mpi_tp.commands.plan import parse_layout, train_config
    lay = parse_layout("tp8 pp16 dp1 b1 v4 +sp +tp-overlap ends7/7", 128)
    assert (lay.first_stage_layers, lay.last_stage_layers, lay.overlap_tp, lay.virtual) == (7, 7, True, 4)
    assert parse_layout(lay.describe(), 128) == lay
    cfg = train_config(w, lay)
    assert (cfg["first_stage_layers"], cfg["last_stage_layers"]) == (7, 7)
    with pytest.raises(UserError, match="ends"):
        price(m, w, Plan(tp=8, pp=16, dp=1, micro_batch=1, first_stage_layers=70, last_stage_layers=70))


def test_tensor_parallel_overlap_as_transformer_engine_runs_it():
    """overlap_tp: a quarter of the tensor-parallel collectives exposed inside a node (TP_OVERLAP_SPLITS = 4,
    NeMo's H100 userbuffer configurations), all of them across nodes (userbuffers need NVLink); off by default:
    the planner prices what mpi_tp runs unless asked (`plan --overlap-tp`)."""
    m = PRESETS["dgx-h100"]
    w = Workload(n_layer=8, n_embd=8192, n_head=64, seq=8192, global_batch=16, attention="flash")
    base, over = (step_time(m, w, Plan(tp=8, dp=1, micro_batch=1, sp=True, overlap_tp=o)) for o in (False, True))
    assert TP_OVERLAP_SPLITS == 4 and over["tp_comm"] == pytest.approx(base["tp_comm"] / 4)
    assert over["total"] == pytest.approx(base["total"] - 0.75 * base["tp_comm"])
    across = [step_time(m, w, Plan(tp=16, micro_batch=1, sp=True, overlap_tp=o))["tp_comm"] for o in (False, True)]
    assert across[0] == across[1] > 0                                        # tp 16 on 8-GPU nodes: the network
    assert not any(x.overlap_tp for x in candidates(w, 8, 8))
    assert all(x.overlap_tp == (x.tp > 1) for x in candidates(w, 8, 8, overlap_tp=True))


def test_megatron_s_distributed_optimizer_memory():
    """ZeRO-1 on the presets (Megatron's distributed optimizer) keeps the fp32 gradient buffer whole and the
    masters and moments a 1/D share, the gradients' share a view of the buffer: 2 + 4 + 12 / D bytes a parameter;
    mpi_tp's own (a calibrated machine) keeps the averaged share besides: + g / D."""
    w = Workload(n_layer=4, n_embd=1024, n_head=16, seq=1024, global_batch=16)
    lay = Plan(tp=2, dp=4, micro_batch=1, zero=1)
    psi = memory_per_rank(PRESETS["dgx-a100"], w, Plan(tp=2, dp=4, micro_batch=1))["parameters"] / 2
    mega = state_per_rank(PRESETS["dgx-a100"], w, lay)
    assert (mega["parameters"], mega["gradients"], mega["optimizer"]) == pytest.approx((2 * psi, 4 * psi,
                                                                                        12 * psi / 4))
    here = Machine(name="here", ranks_per_node=8, gemm_flops=1e10, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e10,
                   intra_alpha=1e-5, intra_bw=1e9, inter_alpha=1e-5, inter_bw=1e9)
    own = state_per_rank(here, w, lay)
    assert own["gradients"] == pytest.approx(4 * psi + 4 * psi / 4)


def test_published_long_context_runs():
    """experiments/planner/published/long_context_runs.json priced (experiments/planner/long_context_layouts.py):
    two runs with context parallelism have their published (t, cp, p) among the planner's first three and within
    20% of their published throughput, every row as run within 30%, and docs/costmodel.md shows the table the
    script prints."""
    import contextlib
    import io
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(os.path.dirname(here), "experiments", "planner"))
    import long_context_layouts
    rows = long_context_layouts.compare()
    good = [r for r in rows if r["layout"][1] > 1 and r["rank"] and r["rank"] <= 3 and abs(r["error"]) <= 0.2]
    assert len(good) >= 2, [(r["name"], r["rank"], r.get("error")) for r in rows]
    assert all(abs(r["as_run_error"]) <= 0.3 for r in rows), [(r["name"], r["as_run_error"]) for r in rows]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        long_context_layouts.main(rows)
    with open(os.path.join(os.path.dirname(here), "docs", "costmodel.md")) as f:
        doc = f.read()
    for line in out.getvalue().splitlines():
        assert line in doc, line
