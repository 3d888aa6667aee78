"""Context parallelism in the whole model against the serial model (float64, dropout 0.1, 3 AdamW steps:
first loss < 1e-10, the rest and every weight < 1e-8), GPT-2 and Llama (grouped-query, untied), in every
tp x cp x dp layout of the pass with cp > 1: cp alone, tp x cp, cp x dp; sequence parallelism on and off
at tp > 1, ZeRO-1 at dp > 1, selective and full recomputation. S = 9 is cut into 2 cp chunks unevenly at
every cp (2, 3, 4). And a checkpoint saved at cp > 1 loads at cp 1 (the serial tensors), and back at cp > 1
(the serial model's loss).
"""
import numpy as np
import pytest
import steps

from mpi_tp.core.testing import all_true, assert_close, gather_full
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

pytestmark = pytest.mark.mpi(min_size=2)
B, S, STEPS = 2, 9, 3
ARCHS = {"gpt2": dict(), "llama": dict(arch="llama", n_kv_head=2, intermediate_size=22)}


def cfg(arch):
    return GPTConfig(vocab_size=37, block_size=S, n_layer=2, n_head=4, n_embd=16, dropout=0.1, **ARCHS[arch])


def global_batch(step, rows):
    return steps.global_batch(step, rows, S=S, seed=11)


def run(config, topo, rows_per_replica, sp=False, zero=False, recompute="none"):
    model = GPT(config, topo, dtype="float64", seed=5, sequence_parallel=sp, recompute=recompute)
    reducer = GradReducer(model, topo.dpcp, bucket_mb=0.001, overlap=True, distributed=zero)
    opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
    return steps.train(model, opt, STEPS, rows_per_replica, global_batch, reducer=reducer), model, opt


def layouts(n):
    """Every (tp, cp, dp) with tp * cp * dp = n and cp > 1."""
    return [(t, c, n // (t * c)) for t in range(1, n + 1) for c in range(2, n + 1) if n % (t * c) == 0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_cp_layout_equals_serial(world, arch):
    for tp, cp, dp in layouts(world.Get_size()):
        ref_losses, ref, _ = run(cfg(arch), Topology.serial(), B * dp)
        ref = {p.name: p.data for p in ref.parameters()}
        for sp, recompute in ([(False, "none"), (True, "selective")] if tp > 1 else [(False, "none"), (False, "full")]):
            topo = Topology.create(world, tp=tp, cp=cp, dp=dp)
            zero = dp > 1
            losses, model, _ = run(cfg(arch), topo, B, sp, zero, recompute)
            what = f"{arch} tp={tp} cp={cp} dp={dp} sp={sp} zero={zero} recompute={recompute}"
            # the sequence was split: ring attention's K/V went around (each rank whole would give the same
            # numbers); per layer and step at least Z - 1 sends forward, 2Z - 1 backward
            sent = topo.stats.calls.get("cp/send", 0)
            assert all_true(sent >= STEPS * 2 * (3 * cp - 2), world), f"{sent} ring messages sent, {what}"
            steps.assert_losses(losses, ref_losses, what)
            for p in steps.compared(model.parameters()):
                assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-8, f"{p.name}, {what}")
                mine = p.data.copy()                     # the cp and dp ranks hold the same weights, bit for bit
                topo.dpcp.comm.Bcast(mine, root=0)
                assert all_true(np.array_equal(mine, p.data), world), f"{p.name} differs over cp x dp, {what}"
            topo.free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule,virtual,recompute", [("1f1b", 1, "none"), ("interleaved", 2, "full")])
def test_cp_with_pipeline_stages_equals_serial(world, schedule, virtual, recompute):
    """cp 2 x pp 2 (world 4): the stages pass this rank's S_r positions; 1F1B, and interleaved with full
    recomputation; Llama untied (its head on the last stage) and GPT-2 tied (two copies of wte)."""
    if world.Get_size() != 4:
        pytest.skip("cp 2 x pp 2 needs 4 ranks")
    for arch in ARCHS:
        config = GPTConfig(**{**cfg(arch).to_dict(), "n_layer": 2 * virtual + 1})
        M = 2
        ref_losses, ref, _ = run(config, Topology.serial(), B * M)
        ref = {p.name: p.data for p in ref.parameters()}
        topo = Topology.create(world, tp=1, cp=2, pp=2, dp=1)
        stage = build_stage(config, topo, "float64", 5, False, schedule, M, virtual, recompute)
        reducer = GradReducer(stage, topo.dpcp, bucket_mb=0.001, overlap=True)
        opt = AdamW(stage.parameters(), lr=1e-2, reducer=reducer)
        losses = steps.train(stage, opt, STEPS, B * M, global_batch, reducer=reducer)
        what = f"{arch} cp=2 pp=2 {schedule} recompute={recompute}"
        assert_close(np.array(losses), ref_losses, 1e-8, f"losses, {what}")
        for p in stage.parameters():
            if not p.name.endswith("attn/k/bias"):
                assert_close(p.data, ref[p.name], 1e-8, f"{p.name}, {what}", comm=topo.cp.comm)
        topo.free()


def test_a_checkpoint_saved_at_cp_loads_without_it(world, tmp_path_factory):
    from mpi_tp import checkpoint as ck
    n = world.Get_size()
    root = world.bcast(str(tmp_path_factory.mktemp("cp_ckpt")) if world.Get_rank() == 0 else None)
    config = cfg("llama")
    _, ref, _ = run(config, Topology.serial(), B)
    topo = Topology.create(world, tp=1, cp=n, dp=1)
    _, model, opt = run(config, topo, B, zero=False)
    ck.save(root, 1, model, opt, {"config": config.to_dict(), "rng": ck.rng_state(model)})
    with ck.Checkpoint(root) as c:
        assert len(c.shards) == 1                     # the cp ranks hold the same weights: one writes
        for p in ref.parameters():
            if not p.name.endswith("attn/k/bias"):
                assert_close(c.read(f"model/{p.name}"), p.data, 1e-8, p.name, comm=world)
    serial = GPT(config, Topology.serial(), dtype="float64")
    with ck.Checkpoint(root) as c:
        ck.load_into(c, serial)
    with ck.Checkpoint(root) as c:
        for p in serial.parameters():
            assert_close(p.data, c.read(f"model/{p.name}"), 0.0, p.name, comm=world)
    again = GPT(config, topo, dtype="float64")               # and back: into a model at cp = world
    with ck.Checkpoint(root) as c:
        ck.load_into(c, again)
    x, y = global_batch(7, B)
    serial.eval(), again.eval()
    assert_close(np.array([again.forward(x, y)]), np.array([serial.forward(x, y)]), 1e-12, "loss at cp", comm=world)
    topo.free()


def test_what_cp_does_not_run_is_one_line(world):
    topo = Topology.create(world, tp=1, cp=world.Get_size())
    model = GPT(cfg("gpt2"), topo)
    with pytest.raises(ConfigError, match="sampling needs the whole sequence"):
        model.last_logits(np.zeros((1, S), dtype=np.int64))
    topo.free()
