"""The first and last pipeline stages' block counts set by hand (layer_ranges(first=, last=); Megatron-Core's
--decoder-first/last-pipeline-num-layers, Llama 3's one block fewer at each end): the split by hand, a
pipelined training run against the serial model at 2, 3 and 4 ranks (1F1B, interleaved, zb-v; float64,
dropout on) with each stage's block count checked, and the options' errors through the command line.

    mpiexec -n 4 python -m mpi4py -m pytest -p no:cacheprovider -q --with-mpi tests/test_stage_ends.py -m mpi
"""
import json

import h5py
import pytest
from jobs import MPIEXEC, mpirun, train_layouts
from steps import assert_losses, compared, train

from mpi_tp.checkpoint.format import shard_name
from mpi_tp.core.errors import UserError
from mpi_tp.core.testing import assert_close, gather_full
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.pipeline.actions import global_chunk
from mpi_tp.parallel.pipeline.stages import layer_ranges
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

B, STEPS = 2, 2                                                    # sequences per micro-batch, AdamW steps
R = range


# -- the split, by hand ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,want", [
    ((10, 4, 1, False, 1, 1), [[R(0, 1)], [R(1, 5)], [R(5, 9)], [R(9, 10)]]),        # Llama 3's: 1 fewer
    ((11, 4, 1, False, 1, 1), [[R(0, 1)], [R(1, 6)], [R(6, 10)], [R(10, 11)]]),        # 9 between: 5, 4
    ((7, 3, 1, False, 1, None), [[R(0, 1)], [R(1, 4)], [R(4, 7)]]),                    # first only
    ((8, 3, 1, False, None, 2), [[R(0, 3)], [R(3, 6)], [R(6, 8)]]),                    # last only
    ((5, 2, 1, False, 2, 3), [[R(0, 2)], [R(2, 5)]]),
    # interleaved, v = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 4, rank 2 chunks 2 and 5;
    # 2, 8, 2 blocks per stage, each cut over its two chunks: 1 + 1, 4 + 4, 1 + 1
    ((12, 3, 2, False, 2, 2), [[R(0, 1), R(6, 7)], [R(1, 5), R(7, 11)], [R(5, 6), R(11, 12)]]),
    # 3, 7, 2 per stage, the extra block of a stage on its chunk 0: chunk sizes 2 4 1 | 1 3 1 in model order
    ((12, 3, 2, False, 3, 2), [[R(0, 2), R(7, 8)], [R(2, 6), R(8, 11)], [R(6, 7), R(11, 12)]]),
    # zb-v: rank 0 holds chunks 0 and 5 (the model's ends), rank 2 chunks 2 and 3 (its middle); 3, 7, 2
    # per stage: chunk sizes 2 4 1 1 3 1 in model order
    ((12, 3, 2, True, 3, 2), [[R(0, 2), R(11, 12)], [R(2, 6), R(8, 11)], [R(6, 7), R(7, 8)]]),
])
def test_layer_ranges_by_hand(args, want):
    assert layer_ranges(*args) == want


@pytest.mark.parametrize("L,P,v,v_shape", [(13, 4, 1, False), (14, 3, 2, False), (20, 4, 3, False),
                                           (13, 3, 2, True), (16, 4, 2, True)])
def test_every_split_keeps_model_order(L, P, v, v_shape):
    """Every allowed (first, last): each block once, chunk g's before chunk g + 1's, the ends' counts as
    asked, the other stages within one block of each other, the larger ones first; each stage's chunks
    within one block of each other, its chunk 0 the largest."""
    for first in [None, *range(v, L)]:
        for last in [None, *range(v, L)]:
            fixed = (first or 0) + (last or 0)
            shared = P - 2 + (first is None) + (last is None)
            if fixed > L - shared * v or (shared == 0 and fixed != L):
                with pytest.raises(UserError):
                    layer_ranges(L, P, v, v_shape, first, last)
                continue
            ranges = layer_ranges(L, P, v, v_shape, first, last)
            by_chunk = sorted((global_chunk(s, j, P, v_shape), r) for s in range(P) for j, r in enumerate(ranges[s]))
            assert [b for _, r in by_chunk for b in r] == list(range(L)), (first, last)
            totals = [sum(len(r) for r in chunks) for chunks in ranges]
            assert (first is None or totals[0] == first) and (last is None or totals[-1] == last)
            ends = {0: first, P - 1: last}
            between = [totals[s] for s in range(P) if ends.get(s) is None]        # the stages sharing the rest
            assert between == sorted(between, reverse=True) and max(between, default=0) - min(between, default=0) <= 1
            for chunks in ranges:
                sizes = [len(r) for r in chunks]
                assert min(sizes) >= 1 and sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


def test_no_ends_set_is_the_even_split():
    """first = last = None: chunk g holds split_sizes(L, P v)[g] blocks, the rule of before."""
    assert layer_ranges(7, 2, 2, True) == [[R(0, 2), R(6, 7)], [R(2, 4), R(4, 6)]]
    assert layer_ranges(70, 12)[0] == [R(0, 6)] and layer_ranges(70, 12)[-1] == [R(65, 70)]


@pytest.mark.parametrize("args,message", [
    ((6, 1, 1, False, 1, None), "at least 2 stages"),
    ((6, 2, 2, False, 1, None), "cannot fill its 2 chunk"),
    ((6, 3, 1, False, 3, 3), "at most 5"),
    ((6, 2, 1, False, 2, 3), "exactly 6"),
])
def test_impossible_ends_are_user_errors(args, message):
    with pytest.raises(UserError, match=message):
        layer_ranges(*args)


def test_the_options_check_allows_what_the_split_allows():
    """TrainConfig's check (in CLI terms) and layer_ranges refuse the same (first, last): one rule."""
    from mpi_tp.model.config import ConfigError
    from mpi_tp.training.config import TrainConfig
    from mpi_tp.training.config_checks import _stage_ends
    for L, P, v in [(6, 2, 1), (7, 3, 1), (9, 4, 1), (8, 2, 2), (10, 3, 2)]:
        for first in range(L + 1):
            for last in range(L + 1):
                try:
                    layer_ranges(L, P, v, False, first or None, last or None)
                    allowed = True
                except UserError:
                    allowed = False
                try:
                    _stage_ends(TrainConfig(n_layer=L, pp=P, virtual_stages=v, first_stage_layers=first,
                                            last_stage_layers=last))
                    checked = True
                except ConfigError:
                    checked = False
                assert allowed == checked, (L, P, v, first, last)


# -- a pipelined run against the serial model ---------------------------------------------------------------

def cfg(n_layer):
    return GPTConfig(vocab_size=37, block_size=7, n_layer=n_layer, n_head=5, n_embd=20, dropout=0.1)


# (schedule, v, L, first, last) for pp = world size; the blocks each stage must hold, by hand
RUNS = {
    2: [("1f1b", 1, 4, 1, 3, [1, 3]), ("interleaved", 2, 6, 2, 4, [2, 4]), ("zb-v", 2, 7, 5, 2, [5, 2])],
    3: [("1f1b", 1, 6, 1, 1, [1, 4, 1]), ("1f1b", 1, 6, 3, None, [3, 2, 1]), ("interleaved", 2, 9, 2, 2, [2, 5, 2])],
    4: [("1f1b", 1, 7, 1, 1, [1, 3, 2, 1]), ("interleaved", 2, 11, 2, 3, [2, 3, 3, 3]),
        ("zb-v", 2, 10, 2, 2, [2, 3, 3, 2])],
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", range(3))
def test_uneven_ends_train_as_the_serial_model(world, case):
    P = world.Get_size()
    if P not in RUNS:
        pytest.skip(f"cases for 2, 3 and 4 ranks; this job has {P}")
    name, v, L, first, last, want = RUNS[P][case]
    M = 2 * P
    what = f"{name} pp={P} v={v} L={L} first={first} last={last}"
    ref = GPT(cfg(L), Topology.serial(), dtype="float64", seed=3)
    ref_losses = train(ref, AdamW(ref.parameters(), lr=1e-2), STEPS, M * B)
    topo = Topology.create(world, tp=1, pp=P, dp=1)
    stage = build_stage(cfg(L), topo, "float64", 3, False, name, M, v, first_stage_layers=first,
                        last_stage_layers=last)
    held = topo.pp.comm.allgather(len(stage.h))                  # the uneven split ran: each stage's blocks
    assert held == want, f"blocks per stage {held}, want {want}, {what}"
    reducer = GradReducer(stage, topo.dp, bucket_mb=0.001)
    losses = train(stage, AdamW(stage.parameters(), lr=1e-2, reducer=reducer), STEPS, M * B, reducer=reducer)
    assert_close(losses, ref_losses, 1e-10, f"losses, {what}")
    assert_losses(losses, ref_losses, what)
    mine = {p.name: p for p in ref.parameters()}
    for p in compared(stage.parameters()):       # stages hold different parameters: agree within the stage
        # the last step's gradients, then the weights after it
        assert_close(gather_full(p, topo.tp.comm, "grad"), mine[p.name].grad, 1e-10, f"grad {p.name}, {what}",
                     comm=topo.tp.comm)
        assert_close(gather_full(p, topo.tp.comm), mine[p.name].data, 1e-10, f"{p.name}, {what}", comm=topo.tp.comm)
    topo.free()


# -- the options, through the command line ------------------------------------------------------------------

cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
SMALL = ["--n-layer", "4", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--steps", "2", "--batch-size",
         "2", "--micro-batches", "2", "--dtype", "float64", "--dropout", "0.1", "--log-every", "1",
         "--eval-every", "2", "--eval-batches", "1", "--sample-len", "0"]


@cli
@pytest.mark.parametrize("args,message", [
    (["--first-stage-layers", "1"], "need --pp 2 or more (got --pp 1)"),
    (["--pp", "2", "--first-stage-layers", "1", "--last-stage-layers", "2"], "must add up to --n-layer 4 (got 3)"),
    (["--pp", "2", "--first-stage-layers", "3", "--last-stage-layers", "2"], "5 blocks, more than --n-layer 4"),
    (["--pp", "2", "--first-stage-layers", "4"], "leave 0 of --n-layer 4 blocks for the other 1 stage(s)"),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--last-stage-layers", "1"],
     "--last-stage-layers 1: that stage's 2 chunks (--virtual-stages 2) need a block each"),
    (["--pp", "2", "--last-stage-layers", "-1"], "must be >= 0"),
])
def test_errors_are_one_line(tmp_path, args, message):
    r = mpirun(2, "train", *SMALL, "--out", str(tmp_path / "o"), *args, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("mpi-tp: error:") == 1, r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@cli
@pytest.mark.launcher
def test_train_with_set_ends_saves_the_serial_models_tensors(tmp_path):
    """`mpi-tp train --pp 2 --first-stage-layers 1 --last-stage-layers 3` trains what --tp 2 trains (the same
    checkpoint tensors, optimizer state included), and stage 0's shard holds one block, stage 1's three."""
    runs, tensors = train_layouts(tmp_path, SMALL, {"tp": ["--tp", "2"], "pp": [
        "--pp", "2", "--first-stage-layers", "1", "--last-stage-layers", "3"]}, step=2)
    assert runs["pp"]["layout"] == {"world": 2, "tp": 1, "pp": 2, "dp": 1}
    assert abs(runs["pp"]["final_val_loss"] - runs["tp"]["final_val_loss"]) < 1e-9
    assert tensors["pp"].keys() == tensors["tp"].keys()
    worst = max(float(abs(tensors["pp"][n] - tensors["tp"][n]).max()) for n in tensors["tp"])
    assert worst < 1e-12, worst
    blocks = []
    for s in range(2):
        with h5py.File(tmp_path / "pp" / "checkpoints" / "step-00000002" / shard_name(s, 2), "r") as f:
            names = []
            f.visit(names.append)
            blocks.append(sorted({n.split("/")[2] for n in names if n.startswith("model/h/") and n.count("/") > 2}))
    assert blocks == [["0"], ["1", "2", "3"]], blocks


@cli
@pytest.mark.launcher
def test_bench_runs_the_set_ends(tmp_path):
    """`mpi-tp bench --pp 2 --first-stage-layers 1 --last-stage-layers 2` times stages of 1 and 2 blocks; ends
    that do not add up are one line."""
    out = tmp_path / "bench.jsonl"
    r = mpirun(2, "bench", "--pp", "2", "--micro-batches", "2", "--custom", "32,2,3,16,2", "--steps", "1",
               "--warmup", "0", "--first-stage-layers", "1", "--last-stage-layers", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text().splitlines()[-1])["blocks_per_stage"] == [1, 2]
    assert "blocks per stage: 1, 2" in r.stdout
    r = mpirun(2, "bench", "--pp", "2", "--custom", "32,2,3,16,2", "--first-stage-layers", "2",
               "--last-stage-layers", "2", timeout=60)
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1 and "exactly 3" in r.stderr, r.stderr
