"""The pipelined GPT against the serial model: every dp x pp x tp layout of the pass, each schedule,
several micro-batch counts, uneven stages, sequence parallelism, dropout on (float64, 3 AdamW steps:
first loss < 1e-10, the rest and every weight < 1e-8), the stages' receives posted ahead (the engine's
default, which changes no number: its posts are checked); and a mixture-of-experts GPT in every such
layout with sequence parallelism, expert parallelism and the distributed optimizer (ZeRO-1)."""
import numpy as np
import pytest
from steps import assert_losses, compared, global_batch, train

from mpi_tp.core.testing import all_true, assert_close, gather_full
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.pipeline.engine import default_prepost
from mpi_tp.parallel.pipeline.schedules import held
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

pytestmark = pytest.mark.mpi(min_size=1)
B, STEPS = 2, 3                                                    # sequences per micro-batch and replica


def cfg(n_layer, **moe):
    return GPTConfig(vocab_size=37, block_size=7, n_layer=n_layer, n_head=5, n_embd=20, dropout=0.1, **moe)


MOE = dict(moe_experts=3, moe_top_k=2, moe_capacity=1.0, moe_aux_weight=0.05, moe_z_weight=0.01)


def serial(n_layer, rows, **moe):
    model = GPT(cfg(n_layer, **moe), Topology.serial(), dtype="float64", seed=3)
    losses = train(model, AdamW(model.parameters(), lr=1e-2), STEPS, rows)
    return losses, {p.name: p.data for p in model.parameters()}


def pipelined(topo, n_layer, name, micro, virtual=1, sp=False, recompute="none", zero=False, **moe):
    stage = build_stage(cfg(n_layer, **moe), topo, "float64", 3, sp, name, micro, virtual, recompute)
    stage.count_activations = True
    reducer = GradReducer(stage, topo.dp, bucket_mb=0.001, overlap=bool(zero), distributed=bool(zero),
                          stage=max(int(zero), 1))
    return train_stage(stage, topo, reducer, micro), stage


def train_stage(stage, topo, reducer, micro):
    """STEPS AdamW steps of a pipeline stage on this replica's rows of the global batches: the losses."""
    opt = AdamW(stage.parameters(), lr=1e-2, reducer=reducer)
    return train(stage, opt, STEPS, micro * B, reducer=reducer)


def layouts(n):
    """(tp, pp, dp) with tp * pp * dp = n, tp at most 2 (pp = 1: one stage running the schedule alone)."""
    return [(t, p, n // (t * p)) for t in (1, 2) for p in range(1, n + 1) if n % (t * p) == 0]


CASES = [("gpipe", 1, 1, "none"), ("gpipe", 3, 1, "selective"), ("1f1b", 1, 1, "none"), ("1f1b", 4, 1, "full"),
         ("interleaved", 0, 2, "none"), ("zb-h1", 3, 1, "none"), ("zb-h1", 4, 1, "full"), ("zb-v", 0, 2, "none"),
         ("zb-v", 3, 2, "selective")]


@pytest.mark.parametrize("name,micro,virtual,recompute", CASES)
def test_pipeline_equals_serial(world, name, micro, virtual, recompute):
    for tp, pp, dp in layouts(world.Get_size()):
        m = micro or pp                                          # interleaved: a multiple of the stages
        n_layer = pp * virtual + 1                               # uneven: one stage (chunk) holds one more
        ref_losses, ref = serial(n_layer, dp * m * B)
        for sp in ([False, True] if tp > 1 else [False]):
            topo = Topology.create(world, tp=tp, pp=pp, dp=dp)
            losses, stage = pipelined(topo, n_layer, name, m, virtual, sp, recompute)
            what = f"{name} tp={tp} pp={pp} dp={dp} M={m} V={virtual} sp={sp} recompute={recompute}"
            assert_losses(losses, ref_losses, what)
            # the stage ran the engine's default: each receive posted default_prepost() actions ahead
            # of its own (one stage receives nothing: its chunks hand their messages over in memory)
            posts, ahead = stage.engine.posts, default_prepost()
            assert all_true(all(j == max(0, k - ahead) for k, j in posts) and bool(posts) == (pp > 1), world), \
                f"receives posted {posts}, want {ahead} actions ahead, {what}"
            # zero-bubble schedules cut the backward: W actions ran the weight gradients B deferred
            assert (stage.weight_calls > 0) == name.startswith("zb"), f"{stage.weight_calls} W calls, {what}"
            # fresh dropout masks each step (the serial reference steps through the same code, so the
            # numbers alone cannot tell): the masks' step key advanced once per training step
            assert stage.dropout.step == STEPS, f"dropout at step {stage.dropout.step} after {STEPS}, {what}"
            for p in compared(stage.parameters()):
                assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-8, f"{p.name}, {what}",
                             comm=topo.tp.comm)     # stages hold different parameters: agree within the stage
            topo.free()


def test_the_tied_table_copies_stay_equal(world):
    """The first stage's wte and the last stage's copy: bitwise equal after training."""
    n = world.Get_size()
    if n < 2:
        pytest.skip("one stage holds both ends: there is no copy")
    topo = Topology.create(world, tp=1, pp=n, dp=1)
    _, stage = pipelined(topo, n, "1f1b", 2)
    mine = [t.weight.data for t in stage.tied_embedding.tables]
    tables = topo.pp.comm.allgather(mine[0] if mine else None)
    assert np.array_equal(tables[0], tables[-1])
    topo.free()


def test_evaluation_and_sampling_equal_serial(world):
    """Forward-only through the stages: the loss of a batch and sampled text equal the serial model's."""
    from mpi_tp.inference.sampling import sample
    n = world.Get_size()
    ref = GPT(cfg(n + 1), Topology.serial(), dtype="float64", seed=3).eval()
    x, y = global_batch(0, 3)
    want_loss, want_text = ref.forward(x, y), sample(ref, b"\x05\x06", 5, temperature=1.0, seed=1)
    for tp, pp, dp in layouts(n):
        topo = Topology.create(world, tp=tp, pp=pp, dp=dp)
        stage = build_stage(cfg(n + 1), topo, "float64", 3, tp > 1, "1f1b", 1).eval()
        assert_close(np.array([stage.forward(x, y)]), np.array([want_loss]), 1e-12, f"eval tp={tp} pp={pp}")
        assert sample(stage, b"\x05\x06", 5, temperature=1.0, seed=1) == want_text
        assert stage.num_params() == ref.num_params()
        topo.free()


def test_checkpoints_between_pipelined_and_serial(world, tmp_path_factory):
    """A checkpoint saved by a pipeline (every stage's shard, the tied table once) holds the serial
    model's tensors, and it loads into a model of another shape (tensor-parallel, one stage)."""
    import shutil

    from mpi_tp import checkpoint as ck
    n = world.Get_size()
    root = world.bcast(str(tmp_path_factory.mktemp("pipe_ckpt")) if world.Get_rank() == 0 else None)
    ref_losses, ref = serial(n + 1, B)
    topo = Topology.create(world, tp=1, pp=n, dp=1)
    losses, stage = pipelined(topo, n + 1, "1f1b", 1)
    opt = AdamW(stage.parameters(), lr=1e-2)
    ck.save(root, 1, stage, opt, {"config": stage.cfg.to_dict(), "rng": ck.rng_state(stage)})
    with ck.Checkpoint(root) as c:
        for name, value in ref.items():
            if name.endswith("attn/k/bias"):
                continue        # exact gradient 0: its value is rounding noise (docs/tensor_parallelism.md)
            assert_close(c.read(f"model/{name}"), value, 1e-12, name, comm=world)
        assert len(c.shards) == n and sum(1 for t in c.tensors if t.startswith("model/")) == len(ref)
    if n > 1:                                   # load at the other shape: tp = n, one stage
        other = Topology.create(world, tp=n if n <= 5 else 1, pp=1, dp=1)
        model = GPT(cfg(n + 1), other, dtype="float64", seed=0)
        with ck.Checkpoint(root) as c:
            ck.load_into(c, model)
        for p in model.parameters():
            if p.name.endswith("attn/k/bias"):
                continue        # as above
            assert_close(gather_full(p, other.tp.comm), ref[p.name], 1e-12, p.name, comm=world)
        other.free()
    topo.free()
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.mpi(min_size=4)
def test_stages_send_one_tth_of_the_activation(world):
    """tp = 2 x pp = 2, no sequence parallelism: each tensor-parallel rank sends its half of each
    activation (forward) and gradient (backward), and the receivers all-gather the halves."""
    if world.Get_size() != 4:
        pytest.skip("needs exactly 4 ranks")
    topo = Topology.create(world, tp=2, pp=2, dp=1)
    M = 3
    pipelined(topo, 3, "1f1b", M)
    n = B * 7 * 20                                     # one micro-batch's activation: b T C values
    half = n // 2 + (n % 2 if topo.tp.rank == 0 else 0)
    snap = topo.stats.snapshot()
    assert snap["pp/send"]["bytes"] == STEPS * M * half * 8           # M messages a step, one way each
    assert snap["pp/send"]["calls"] == STEPS * M
    topo.free()


def test_activations_held_follow_the_schedule(world):
    """The bytes of activations a stage holds at its peak: one micro-batch's times min(P - s, M) under
    1F1B, times M under GPipe; full recomputation holds less (float64, measured from the caches)."""
    n = world.Get_size()
    topo = Topology.create(world, tp=1, pp=n, dp=1)
    s, M = topo.pp.rank, 4
    peak = {}
    for name, micro, recompute in (("1f1b", 1, "none"), ("1f1b", M, "none"), ("gpipe", M, "none"),
                                   ("1f1b", M, "full"), ("zb-h1", M, "none")):
        _, stage = pipelined(topo, n, name, micro, recompute=recompute)
        peak[name, micro, recompute] = stage.peak_activation_bytes
        bound = held(stage.engine.actions)
    one = peak["1f1b", 1, "none"]
    assert peak["1f1b", M, "none"] == min(n - s, M) * one
    assert peak["gpipe", M, "none"] == M * one
    assert peak["1f1b", M, "full"] < peak["1f1b", M, "none"]
    # zb-h1: 1F1B's micro-batches between F and B, and on stage s up to s more whose W inputs wait (what
    # a W keeps, its GEMMs' inputs and output gradients, is less than what the forward kept)
    assert peak["1f1b", M, "none"] <= peak["zb-h1", M, "none"] <= bound * one
    assert bound == min(n, M)
    topo.free()


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_experts_in_every_layout_equal_serial(world, name):
    """Mixture of experts (3 experts, top-2, a capacity that drops, aux and z-losses) in every tp x pp x dp
    layout: sequence parallelism at tp > 1, the experts over ep = dp (3 experts split unevenly at dp = 2),
    the distributed optimizer at dp > 1 (ZeRO-2 under zb-h1), 1F1B or ZB-H1 over 2 micro-batches; every stage's MoE losses reach the loss."""
    for tp, pp, dp in layouts(world.Get_size()):
        n_layer = pp + 1
        ref_losses, ref = serial(n_layer, dp * 2 * B, **MOE)
        ep = dp if dp <= MOE["moe_experts"] else 1
        topo = Topology.create(world, tp=tp, pp=pp, dp=dp, ep=ep)
        zero = (2 if name == "zb-h1" else 1) if dp > 1 else 0          # ZeRO-2 under the zero-bubble schedule
        losses, stage = pipelined(topo, n_layer, name, 2, sp=tp > 1, zero=zero, **MOE)
        what = f"MoE {name} tp={tp} pp={pp} dp={dp} ep={ep} sp={tp > 1} zero={zero}"
        assert_close(losses[:1], ref_losses[:1], 1e-10, f"first loss, {what}")
        assert_close(losses, ref_losses, 1e-8, f"losses, {what}")
        for p in stage.parameters():
            if p.name.endswith("attn/k/bias"):
                continue
            assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-8, f"{p.name}, {what}", comm=topo.tp.comm)
        topo.free()
