"""The Llama model in every tp x pp x dp layout of the pass against the serial model (float64, 3 AdamW steps:
first loss < 1e-10, the rest and every weight < 1e-8): sequence parallelism on and off, ZeRO-1 and the
overlapped data-parallel buckets, each pipeline schedule with recomputation, an untied head (on the last
stage) and a tied one (two copies summed), grouped-query attention with replicated key/value heads
(H_kv = 1 < tp) and split ones; and checkpoints saved at one layout load at another.

World 4 runs tp = 4 (H_kv = 1: 4 replicas; H_kv = 2: 2 + 2) and tp = 2 with pp = 2 or dp = 2; world 3 runs
tp = 3 (H_kv = 2: kv 0 on ranks 0 and 1, kv 1 on rank 2: uneven replicas) and pp = 3 or dp = 3.
"""
import pytest
from steps import train

from mpi_tp.core.testing import assert_close, gather_full
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

pytestmark = pytest.mark.mpi(min_size=1)
B, STEPS = 2, 3


def cfg(n_layer, **kw):
    return GPTConfig(vocab_size=37, block_size=7, n_layer=n_layer, n_head=4, n_embd=16, dropout=0.1, arch="llama",
                     intermediate_size=22, **kw)


def serial(config, rows):
    model = GPT(config, Topology.serial(), dtype="float64", seed=3)
    losses = train(model, AdamW(model.parameters(), lr=1e-2), STEPS, rows)
    return losses, {p.name: p.data for p in model.parameters()}


def pipelined(config, topo, name, micro, virtual=1, sp=False, recompute="none", zero=False, overlap=True):
    stage = build_stage(config, topo, "float64", 3, sp, name, micro, virtual, recompute)
    reducer = GradReducer(stage, topo.dp, bucket_mb=0.001, overlap=overlap, distributed=zero)
    opt = AdamW(stage.parameters(), lr=1e-2, reducer=reducer)
    return train(stage, opt, STEPS, micro * B, reducer=reducer), stage, opt


def layouts(n):
    """Every (tp, pp, dp) with tp * pp * dp = n."""
    return [(t, p, n // (t * p)) for t in range(1, n + 1) for p in range(1, n + 1) if n % (t * p) == 0]


CASES = [("1f1b", 2, 1, "none", dict(n_kv_head=1)),
         ("gpipe", 2, 1, "selective", dict(n_kv_head=2, tie_word_embeddings=True)),
         ("interleaved", 0, 2, "full", dict(n_kv_head=2))]


@pytest.mark.parametrize("name,micro,virtual,recompute,heads", CASES, ids=[c[0] for c in CASES])
def test_llama_layouts_equal_serial(world, name, micro, virtual, recompute, heads):
    for tp, pp, dp in layouts(world.Get_size()):
        m = micro or pp                                          # interleaved: a multiple of the stages
        n_layer = pp * virtual + 1                               # uneven: one stage (chunk) holds one more
        ref_losses, ref = serial(cfg(n_layer, **heads), dp * m * B)
        for sp in ([False, True] if tp > 1 else [False]):
            topo = Topology.create(world, tp=tp, pp=pp, dp=dp)
            zero = dp > 1 and sp                                 # ZeRO-1 in every other data-parallel run
            losses, stage, _ = pipelined(cfg(n_layer, **heads), topo, name, m, virtual, sp, recompute, zero,
                                         overlap=not sp or zero)
            what = f"{name} tp={tp} pp={pp} dp={dp} sp={sp} zero={zero} {heads}"
            assert_close(losses[:1], ref_losses[:1], 1e-10, f"first loss, {what}")
            assert_close(losses, ref_losses, 1e-8, f"losses, {what}")
            for p in stage.parameters():
                assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-8, f"{p.name}, {what}",
                             comm=topo.tp.comm)     # stages hold different parameters: agree within the stage
            topo.free()


def test_checkpoints_between_layouts(world, tmp_path_factory):
    """Saved by tp x pp (untied lm_head on the last stage, replicated kv heads written once), with
    ZeRO-1 state when there are replicas: the serial tensors; loaded at tp = world and serially."""
    import shutil

    from mpi_tp import checkpoint as ck
    n = world.Get_size()
    root = world.bcast(str(tmp_path_factory.mktemp("llama_ckpt")) if world.Get_rank() == 0 else None)
    tp, pp = (2, n // 2) if n % 2 == 0 else (1, n)
    config = cfg(pp + 1, n_kv_head=1)
    ref_losses, ref = serial(config, 2 * B)
    topo = Topology.create(world, tp=tp, pp=pp, dp=1)
    _, stage, opt = pipelined(config, topo, "1f1b", 2)
    ck.save(root, 1, stage, opt, {"config": config.to_dict(), "rng": ck.rng_state(stage)})
    with ck.Checkpoint(root) as c:
        for name, value in ref.items():
            assert_close(c.read(f"model/{name}"), value, 1e-8, name, comm=world)
        assert sum(1 for t in c.tensors if t.startswith("model/")) == len(ref) and "model/lm_head" in c.tensors
    for other in (Topology.create(world, tp=n, pp=1, dp=1), Topology.serial()):
        model = GPT(GPTConfig(**config.to_dict()), other, dtype="float64", seed=0)
        fresh = AdamW(model.parameters())
        with ck.Checkpoint(root) as c:
            ck.load_into(c, model, fresh)
        for p in model.parameters():
            assert_close(gather_full(p, other.tp.comm), ref[p.name], 1e-8, f"{p.name} at tp={other.tp.size}",
                         comm=world)
    topo.free()
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


MOE = dict(moe_experts=3, moe_top_k=2, moe_capacity=1.0, moe_aux_weight=0.05, moe_z_weight=0.01)


def test_swiglu_experts_in_every_layout_equal_serial(world):
    """Llama with mixture-of-experts blocks (SwiGLU experts, top-2 of 3, a capacity that drops) and one
    key/value head: every tp x pp x dp layout, SP at tp > 1, the experts over ep = dp, ZeRO-1 at dp > 1."""
    for tp, pp, dp in layouts(world.Get_size()):
        config = cfg(pp + 1, n_kv_head=1, **MOE)
        ref_losses, ref = serial(config, dp * 2 * B)
        ep = dp if dp <= MOE["moe_experts"] else 1
        topo = Topology.create(world, tp=tp, pp=pp, dp=dp, ep=ep)
        losses, stage, _ = pipelined(config, topo, "1f1b", 2, sp=tp > 1, zero=dp > 1)
        what = f"llama MoE tp={tp} pp={pp} dp={dp} ep={ep}"
        assert_close(losses[:1], ref_losses[:1], 1e-10, f"first loss, {what}")
        assert_close(losses, ref_losses, 1e-8, f"losses, {what}")
        assert any("/experts/" in p.name and p.name.endswith("/gate/weight") for p in stage.parameters()) or \
            not any(b.moe for b in stage.h)
        for p in stage.parameters():
            assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-8, f"{p.name}, {what}", comm=topo.tp.comm)
        topo.free()
