"""The planner prices Llama shapes (mpi_tp.planning.workload): its counts against the model's own, not a
re-derivation. Parameters against GPT(cfg) (whole at tp 1, a rank's share at tp = the world, H_kv < T:
replicated key/value heads), GEMM FLOPs against the products the model's linear layers run in one training
step (mpi_tp.core.kernels.matmul, 2 m n k each), activations against the caches a llama block keeps, and
`mpi-tp plan --model` on a transformers-made config.json and an mpi_tp checkpoint against the options."""
import argparse

import numpy as np
import pytest

from mpi_tp.core import kernels
from mpi_tp.core.errors import UserError
from mpi_tp.core.testing import all_true
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.activations import Shape, activation_terms, measured_terms
from mpi_tp.planning.costmodel import Plan, Workload, model_flops_per_step
from mpi_tp.planning.memory import params_per_rank

# H, F and V divide by 1 ... 4: every rank's share equal; hs = 4, even (rotary pairs)
C, H, F, V, L = 48, 12, 72, 48, 2


def llama(H_kv, tied=False, S=8, **more):
    cfg = GPTConfig(arch="llama", vocab_size=V, block_size=S, n_layer=L, n_head=H, n_embd=C, n_kv_head=H_kv,
                    intermediate_size=F, tie_word_embeddings=tied, **more)
    w = Workload(L, C, H, S, 8, V, arch="llama", n_kv_head=H_kv, intermediate_size=F, tie_embeddings=tied,
                 dropout=cfg.dropout > 0)
    return cfg, w


def kv_choices(T):
    """H_kv = 1 (replicated on every rank when T > 1), and one that T divides (split, one head a rank)."""
    return (1, T if T > 1 else 3)


@pytest.mark.parametrize("H_kv, tied", [(1, False), (3, True), (12, False)])
def test_params_equal_the_models_count(H_kv, tied):
    cfg, w = llama(H_kv, tied)
    model = GPT(cfg, Topology.serial())
    assert w.params == model.num_params() == sum(p.data.size for p in model.parameters())
    assert params_per_rank(w, Plan()) == w.params
    gpt2 = GPTConfig(vocab_size=V, block_size=8, n_layer=L, n_head=H, n_embd=C, intermediate_size=F)
    assert Workload(L, C, H, 8, 8, V, intermediate_size=F).params == GPT(gpt2, Topology.serial()).num_params()


@pytest.mark.mpi(min_size=1)
def test_a_ranks_share_equals_its_parameters(world):
    """At tp = the world (2 or 3 or 4: H_kv = 1 is replicated on every rank), a rank's parameters."""
    T, bad = world.Get_size(), []
    for H_kv in kv_choices(T):
        for tied in (False, True):
            cfg, w = llama(H_kv, tied)
            topo = Topology.create(world)
            model = GPT(cfg, topo)
            got = sum(p.data.size for p in model.parameters())
            if got != params_per_rank(w, Plan(tp=T)):
                bad.append((H_kv, tied, got, params_per_rank(w, Plan(tp=T))))
            topo.free()
    assert all_true(not bad, world), bad


@pytest.mark.mpi(min_size=1)
def test_gemm_flops_equal_the_products_run(world, monkeypatch):
    """One forward and backward: the linear layers' products (q/k/v, projection, SwiGLU's gate|up and down, the
    output layer), 2 m n k each, are 3 x 2 B S (L layer_macs(T) + C V / T) on every rank; the model FLOPs
    of a step are the same count, whole, plus attention's (GPT-2's formula for it)."""
    T, B, S, bad = world.Get_size(), 2, 72, []           # B S > 128 rows: every product through matmul
    flops = []
    real = kernels.matmul

    def counted(a, b, out=None):
        flops.append(2 * a.shape[0] * a.shape[1] * b.shape[1])
        return real(a, b, out=out)
    monkeypatch.setattr(kernels, "matmul", counted)
    for H_kv in kv_choices(T):
        cfg, w = llama(H_kv, S=S)
        topo = Topology.create(world)
        model = GPT(cfg, topo)
        x = np.arange(B * S).reshape(B, S) % V
        flops.clear()
        model.forward(x, x)
        model.backward()
        want = 3 * 2 * B * S * (L * w.layer_macs(T) + C * V / T)
        if sum(flops) != want:
            bad.append((H_kv, sum(flops), want))
        topo.free()
        if T == 1:
            one = Workload(L, C, H, S, B, V, arch="llama", n_kv_head=H_kv, intermediate_size=F)
            attention = 12 * B * S * S * L * C                      # 72 B S L C^2 S / (6 C): QK^T and AV
            assert model_flops_per_step(one) == pytest.approx(sum(flops) + attention, rel=1e-12)
    assert all_true(not bad, world), bad


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_llama_blocks_activations_equal_its_caches(world, recompute):
    T, S, B, bad = world.Get_size(), 12, 2, []
    for H_kv in kv_choices(T):
        for sp in (False, True):
            for p in (0.0, 0.1):
                cfg, w = llama(H_kv, S=S, dropout=p)
                topo = Topology.create(world)
                model = GPT(cfg, topo, dtype="float32", sequence_parallel=sp, recompute=recompute)
                x = np.zeros((B, S), dtype=np.int64)
                model.forward(x, x)
                want = activation_terms(S, B, C, H, T, sp, p > 0, recompute, shape=Shape.of(w))
                for block in model.h:
                    got = measured_terms(block)
                    if got != want or sum(got.values()) != block.activation_bytes():
                        bad.append((H_kv, sp, p, got, want, block.activation_bytes()))
                topo.free()
    assert all_true(not bad, world), bad[:1]


def _workload(argv):
    from mpi_tp.commands import plan
    from mpi_tp.commands.plan_shape import apply_model
    ap = argparse.ArgumentParser()
    plan.add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", *argv])
    if args.model:
        apply_model(args)
    return plan._check(args)[1]


def test_plan_model_reads_a_transformers_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(hidden_size=C, num_attention_heads=H, num_key_value_heads=3, intermediate_size=F,
                             num_hidden_layers=L, vocab_size=V, max_position_embeddings=64,
                             tie_word_embeddings=False).save_pretrained(tmp_path)
    explicit = _workload(["--arch", "llama", "--layers", str(L), "--hidden", str(C), "--heads", str(H),
                          "--n-kv-head", "3", "--intermediate-size", str(F), "--untie-embeddings", "--vocab", str(V),
                          "--seq", "64", "--global-batch", "8"])
    for path in (tmp_path, tmp_path / "config.json"):
        assert _workload(["--model", str(path), "--global-batch", "8"]) == explicit
    assert explicit.params == GPT(GPTConfig(arch="llama", vocab_size=V, block_size=64, n_layer=L, n_head=H,
                                            n_embd=C, n_kv_head=3, intermediate_size=F)).num_params()
    override = _workload(["--model", str(tmp_path), "--global-batch", "8", "--seq", "32", "--n-kv-head", "1",
                          "--tie-embeddings"])
    assert (override.seq, override.kv_heads, override.tied, override.ffn) == (32, 1, True, F)


def test_plan_model_reads_a_checkpoint(tmp_path):
    from mpi_tp import checkpoint as ck
    cfg, w = llama(4, S=16)
    model = GPT(cfg, Topology.serial())
    ck.save(str(tmp_path), 1, model, None, {"config": model.cfg.to_dict()})
    got = _workload(["--model", str(tmp_path), "--global-batch", "8"])
    assert got == Workload(L, C, H, 16, 8, V, arch="llama", n_kv_head=4, intermediate_size=F, tie_embeddings=False)


@pytest.mark.parametrize("make, says", [(lambda p: p / "absent", "does not exist"),
                                        (lambda p: p, "no complete checkpoint"),
                                        (lambda p: (p / "config.json").write_text("{\"n_embd\": 4}") and p,
                                         "not a Hugging Face model's config.json"),
                                        (lambda p: (p / "config.json").write_text("{oops") and p / "config.json",
                                         "unreadable")])
def test_a_bad_model_path_is_one_clear_error(tmp_path, make, says):
    with pytest.raises(UserError, match=says) as e:
        _workload(["--model", str(make(tmp_path)), "--global-batch", "8"])
    assert "--model" in str(e.value) and "\n" not in str(e.value)


def test_llama_options_need_llama():
    with pytest.raises(UserError, match="add --arch llama"):
        _workload(["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "8", "--global-batch", "8",
                   "--n-kv-head", "2"])


def test_the_docs_hand_worked_llama_numbers():
    """docs/costmodel.md section 7 works Llama 3.1 8B's parameters, and a rank's share of a block at tp 16, by hand."""
    from pathlib import Path
    text = " ".join((Path(__file__).parent.parent / "docs" / "costmodel.md").read_text().split())
    w = Workload(32, 4096, 32, 8192, 512, 128256, arch="llama", n_kv_head=8, intermediate_size=14336)
    split, whole = w.layer_split(16)
    assert f"= {w.params:,} parameters" in text and f"= {split // 16 + whole:,} of a block's" in text
    assert split % 16 == 0 and whole - 2 * 4096 == 2 * 4096 * 128 == 1_048_576


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_mixture_of_swiglu_experts_counts_as_the_model(arch):
    """Every other block an MoE block of 4 experts (llama: SwiGLU, 3 C F each), 0 to 2 shared experts."""
    for n in (0, 1, 2):
        cfg = GPTConfig(arch=arch, vocab_size=V, block_size=8, n_layer=4, n_head=H, n_embd=C, intermediate_size=F,
                        n_kv_head=3 if arch == "llama" else None, moe_experts=4, moe_top_k=2, moe_every=2,
                        moe_shared_experts=n)
        w = Workload(4, C, H, 8, 8, V, experts=4, top_k=2, moe_every=2, shared_experts=n, arch=arch,
                     n_kv_head=cfg.n_kv_head, intermediate_size=F)
        assert w.params == GPT(cfg, Topology.serial()).num_params(), (arch, n)
    assert Workload(2, C, H, 8, 8, V, arch="llama", intermediate_size=F).expert_params == 3 * C * F
