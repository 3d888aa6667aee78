"""The Llama model at tp = world size equals the serial model: loss, every gradient, 20 AdamW steps,
grouped-query attention with fewer key/value heads than ranks (replicas) and with more, an untied head.

Head layouts exercised (mpi_tp.model.heads; tests/run.sh runs 1, 2, 3 and 4 ranks), H = 4 query heads:
    H_kv = 4:  tp = 2: 2 + 2 kv heads, tp = 3: 2 + 1 + 1, tp = 4: one each (their own)
    H_kv = 2:  tp = 2: one each; tp = 3: kv 0 on ranks 0, 1 (replicas), kv 1 on rank 2; tp = 4: two replicas each
    H_kv = 1:  every rank a replica of the one kv head (tp = 2, 3, 4)
and H = 6, H_kv = 3 (tp = 2: kv 2 + 1, query heads 4 + 2). MLP width F = 22: 11 + 11, 8 + 7 + 7, 6 + 6 + 5 + 5.
"""
import numpy as np
import pytest
import steps as tests_steps

from mpi_tp.core.testing import all_true, assert_close, gather_full, randomize
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.model.heads import head_layout
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW, clip_grad_norm

pytestmark = pytest.mark.mpi(min_size=1)
CFG = dict(vocab_size=37, block_size=8, n_layer=2, n_head=4, n_embd=16, arch="llama", intermediate_size=22)
HEADS = [dict(n_kv_head=4), dict(n_kv_head=2), dict(n_kv_head=1), dict(n_head=6, n_embd=24, n_kv_head=3)]
HEAD_IDS = ["H_kv=4", "H_kv=2", "H_kv=1", "H=6-H_kv=3"]


def batch(seed, B=3, S=8, V=37):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, S)), rng.integers(0, V, (B, S))


def pair(world, sp=False, **over):
    cfg = dict(CFG, **over)
    ser = GPT(GPTConfig(**cfg), Topology.serial(), dtype="float64", seed=11)
    par = GPT(GPTConfig(**cfg), Topology.create(world), dtype="float64", seed=11, sequence_parallel=sp)
    return ser, par


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loss_and_gradients(world, heads, tied):
    for sp in ([False, True] if world.Get_size() > 1 else [False]):
        ser, par = pair(world, sp, tie_word_embeddings=tied, **heads)
        assert ser.cfg.llama and (("lm_head" in {p.name for p in ser.parameters()}) != tied)
        randomize(ser, std=0.1), randomize(par, std=0.1)
        x, y = batch(0)
        assert_close(np.array(par.forward(x, y)), np.array(ser.forward(x, y)), 1e-10, f"loss sp={sp}")
        ser.backward(), par.backward()
        finalize_grads(par)                      # sp: the RMSNorm weights; H_kv < T: the key/value replicas
        scale = max(float(np.abs(p.grad).max()) for p in ser.parameters())
        serial = {p.name: p for p in ser.parameters()}
        for p in par.parameters():
            q = serial[p.name]
            assert_close(p.grad, q.grad[p.index()], 1e-10, f"{p.name}.grad (local) sp={sp}", scale)
            assert_close(gather_full(p, world, "grad"), q.grad, 1e-10, f"{p.name}.grad (gathered) sp={sp}", scale)


def train(model, steps):
    """The library's AdamW steps (mpi_tp.training.step) on two batches, revisited: the loss must fall."""
    opt = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return tests_steps.train(model, opt, steps, 3, lambda k, rows: batch(100 + k % 2))


@pytest.mark.parametrize("heads", HEADS[1:3], ids=HEAD_IDS[1:3])
def test_twenty_adamw_steps(world, heads):
    ser, par = pair(world, **heads)
    ref, got = train(ser, 20), train(par, 20)
    assert ref[-1] < ref[0] - 0.1, "the serial model did not learn: the test would prove nothing"
    assert_close(got, ref, 1e-8, "loss curve")
    serial = {p.name: p for p in ser.parameters()}
    for p in par.parameters():
        assert_close(gather_full(p, world), serial[p.name].data, 1e-8, f"{p.name} after 20 steps")
    # every replica of a key/value head (and every replicated RMSNorm weight) the same, bit for bit
    for p in par.parameters():
        group = p.replicas.comm if p.replicas is not None else world if not p.sharded else None
        if group is not None:
            mine = p.data.copy()
            group.Bcast(mine, root=0)
            assert all_true(np.array_equal(mine, p.data), world), f"{p.name} differs between the ranks holding it"


def test_replicas_hold_one_head_and_are_counted_once(world):
    """H_kv = 1 < T: every rank holds the one key/value head (its shard is the whole of k and v); the gradient
    norm counts it once, as the serial model does."""
    ser, par = pair(world, n_kv_head=1)
    k = next(p for p in par.parameters() if p.name == "h/0/attn/k/weight")
    assert (k.start, k.stop) == (0, 4) and k.data.shape == (16, 4)
    assert (k.replicas is not None) == (world.Get_size() > 1)
    for m in (ser, par):
        m.forward(*batch(1))
        m.backward()
    finalize_grads(par)
    norms = [clip_grad_norm(m.parameters(), m.topo.tp, 0.0) for m in (ser, par)]
    assert_close(np.array(norms[1]), np.array(norms[0]), 1e-12, "gradient norm")


def test_head_layout_rule():
    """mpi_tp.model.heads: kv heads split when H_kv >= T, ranks split among kv heads when H_kv < T."""
    lay = head_layout(8, 4, 2)
    assert [list(r) for r in lay.q] == [[0, 1, 2, 3], [4, 5, 6, 7]] and [list(r) for r in lay.kv] == [[0, 1], [2, 3]]
    lay = head_layout(6, 3, 2)
    assert [len(r) for r in lay.q] == [4, 2] and [list(r) for r in lay.kv] == [[0, 1], [2]]
    lay = head_layout(4, 2, 3)
    assert [list(r) for r in lay.q] == [[0], [1], [2, 3]] and [list(r) for r in lay.kv] == [[0], [0], [1]]
    assert lay.replicated and lay.replicas(0) == [0, 1] and lay.replicas(2) == [2]
    assert "a replica, also on rank 1" in lay.describe(0)
    lay = head_layout(5, 5, 2)                   # plain multi-head attention: GPT-2's split
    assert [len(r) for r in lay.q] == [3, 2] and lay.q == lay.kv and not lay.replicated
    for H in range(1, 9):                        # every T <= H works, every head served exactly once
        for H_kv in (k for k in range(1, H + 1) if H % k == 0):
            for T in range(1, H + 1):
                lay = head_layout(H, H_kv, T)
                assert sorted(h for r in lay.q for h in r) == list(range(H))
                assert all(len(q) >= 1 and all(h // (H // H_kv) in kv for h in q) for q, kv in zip(lay.q, lay.kv))


def test_bad_configs():
    def bad(match, tp=1, **kw):
        with pytest.raises(ConfigError, match=match):
            GPTConfig(**kw).validate(tp=tp)
    bad("arch 'bert'", arch="bert")
    bad("must be a positive integer dividing n_head", arch="llama", n_head=4, n_embd=16, n_kv_head=3)
    bad("must be a positive integer dividing n_head", arch="llama", n_head=4, n_embd=16, n_kv_head=0)
    bad("grouped-query attention is a llama option", n_head=4, n_embd=16, n_kv_head=2)
    bad("always ties", tie_word_embeddings=False)
    bad("head size n_embd / n_head = 3 must be even", arch="llama", n_head=4, n_embd=12)
    bad("intermediate_size = 0", intermediate_size=0)
    bad("cannot be split over 3", tp=3, arch="llama", n_head=4, n_embd=16, intermediate_size=2)
    bad("rope_theta", arch="llama", rope_theta=0.0)
    bad("norm_eps", norm_eps=-1.0)
    bad("exceeds n_head", tp=5, arch="llama", n_head=4, n_embd=16, n_kv_head=1)
    cfg = GPTConfig(arch="llama", n_embd=128)
    assert cfg.kv_heads == 4 and cfg.ffn == 344 and not cfg.tied
    from mpi_tp.model.llama import parameter_shapes
    for config in (cfg, GPTConfig(arch="llama", n_layer=3, moe_experts=2, moe_every=2, tie_word_embeddings=True)):
        model = GPT(config, Topology.serial(), dtype="float32")
        assert {p.name: p.global_shape for p in model.parameters()} == parameter_shapes(config)
    assert GPTConfig().ffn == 512 and GPTConfig().tied and GPTConfig().resolved().n_kv_head == 4


def test_saved_configurations_compare_by_what_they_mean():
    """A checkpoint's config without the Llama fields (saved before they existed) loads as gpt2; None and the
    value it stands for are the same model; another arch or H_kv is refused with the differences named."""
    import shutil
    import tempfile

    from mpi_tp import checkpoint as ck
    root = tempfile.mkdtemp(prefix="mpi_tp_llama_cfg_")              # one per rank: serial models
    old = GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=4, n_embd=16)
    saved = {k: v for k, v in old.to_dict().items()
             if k not in ("arch", "n_kv_head", "intermediate_size", "rope_theta", "norm_eps", "tie_word_embeddings")}
    ck.save(root, 1, GPT(old, Topology.serial(), dtype="float64"), None, {"config": saved})
    with ck.Checkpoint(root) as c:
        ck.load_into(c, GPT(GPTConfig(**saved), Topology.serial(), dtype="float64"))
        ck.load_into(c, GPT(GPTConfig(**saved, n_kv_head=4, intermediate_size=64, tie_word_embeddings=True),
                            Topology.serial(), dtype="float64"))
        with pytest.raises(ck.CheckpointError, match="arch: checkpoint gpt2 vs model llama"):
            ck.load_into(c, GPT(GPTConfig(**saved, arch="llama"), Topology.serial(), dtype="float64"))
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "swiglu-experts"])
def test_serial_gradients_match_finite_differences(moe):
    """The serial Llama model's backward against central differences of its loss, a few elements of every
    parameter (float64; grouped-query attention, untied head; with SwiGLU experts, dropless top-2 of 3):
    the wiring of the kernels, which tests/test_kernels_llama.py checks one by one."""
    experts = dict(moe_experts=3, moe_top_k=2, moe_aux_weight=0.05, moe_z_weight=0.01) if moe else {}
    model = GPT(GPTConfig(**dict(CFG, n_layer=2, n_kv_head=2, **experts)), Topology.serial(), dtype="float64",
                seed=5)
    randomize(model, std=0.3)
    x, y = batch(3, B=2)
    model.forward(x, y)
    model.backward()
    rng = np.random.default_rng(0)
    for p in model.parameters():
        for flat in rng.choice(p.data.size, size=min(3, p.data.size), replace=False):
            i = np.unravel_index(flat, p.data.shape)        # (q, k, v: views into one array, not reshaped)
            old = p.data[i]
            p.data[i] = old + 1e-6
            up = model.forward(x, y)
            p.data[i] = old - 1e-6
            down = model.forward(x, y)
            p.data[i] = old
            numeric = (up - down) / 2e-6
            assert abs(numeric - p.grad[i]) <= 1e-6 * max(1.0, abs(numeric)), (p.name, i, numeric, p.grad[i])
