"""Hugging Face Mixtral folders in and out (mpi_tp.checkpoint.hf): against transformers' MixtralForCausalLM.

A tiny random Mixtral saved by transformers (float64; 4 experts, top-2, grouped-query attention; every
weight moved off its initial value) is read at the pass's world size as tp = world (3: heads, key/value
heads and each expert's width split unevenly) and with the experts divided among expert-parallel groups
(EXPERT_LAYOUTS: whole experts over ep = 2 at 2 ranks and ep = 3 at 3 (4 experts: 2, 1, 1); ep 2 at etp 2
and tp 2 x dp 2 x ep 2 at 4): each rank's shard is its slice of the serial model's, each expert on one
member of its group, the logits equal transformers' (which runs its norms and rotary angles in float32:
1e-6; the float64 Mixtral throughout, to 1e-9), and greedy generation gives transformers' own
`generate(do_sample=False)` tokens. The same model saved with its experts fused (transformers 5's
save_original_format=False) reads the same shards, so the same logits bit for bit. Exported back, the
folder holds the same tensors bit for bit and transformers loads it; a mixture of experts built in mpi_tp,
saved at tp = world and exported, gives transformers mpi_tp's logits; what Mixtral cannot compute is refused
in one line (more in test_hf_mixtral_refusals.py).

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_hf_mixtral.py     (N = 1 .. 4)
"""
import json
import os

import numpy as np
import pytest
from test_hf import (  # noqa: F401
    IDS,
    LLAMA_TOL,
    assert_like_oracle,
    check_shards,
    greedy_oracle,
    loaded,
    needs_oracle,
    shared_dir,
)

from mpi_tp.checkpoint import open_checkpoint
from mpi_tp.checkpoint.format import CheckpointError
from mpi_tp.checkpoint.hf.write import export
from mpi_tp.core.errors import UserError
from mpi_tp.core.testing import all_true, assert_close, from_rank0
from mpi_tp.parallel.topology import Topology

SIZES = dict(vocab_size=97, hidden_size=24, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=3, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
             rope_theta=1000.0, rms_norm_eps=1e-6)
PROMPTS = [IDS[0, :5], IDS[1, :1], IDS[2, :12]]
NEW = 12
# beside tp = world: whole experts over ep = world (4 experts over 3 ranks: 2, 1, 1), ep 2 at etp 2, tp 2 x dp 2 x ep 2
EXPERT_LAYOUTS = {2: [dict(ep=2, etp=1)], 3: [dict(ep=3, etp=1)], 4: [dict(ep=2, etp=2), dict(tp=2, dp=2, ep=2)]}


def mixtral_folder(path, seed=0, fused=False, **overrides):
    """A random-weight MixtralForCausalLM in float64 saved by save_pretrained (norms moved off ones too); fused:
    its experts as transformers 5 keeps them (save_original_format=False), else the Hub's per-expert names."""
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(**{**SIZES, **overrides}, bos_token_id=None, eos_token_id=None,
                                        pad_token_id=None)
    model = transformers.MixtralForCausalLM(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, save_original_format=not fused)
    return model


def eager(path, dtype="float64"):
    """The folder in transformers, experts computed one by one (its grouped product takes no float64)."""
    import torch
    import transformers
    return transformers.MixtralForCausalLM.from_pretrained(path, experts_implementation="eager",
                                                           dtype=getattr(torch, dtype)).eval()


def oracle(folder):
    """Logits at S = 1, 3, 32 (as loaded: float64 weights) and greedy continuations of PROMPTS."""
    mixtral_folder(folder, seed=3)
    return greedy_oracle(eager(folder), PROMPTS, NEW, (1, 3, 32))


@needs_oracle
@pytest.mark.mpi(min_size=1)
def test_mixtral_logits_and_greedy_text_equal_transformers(world, shared_dir):  # noqa: F811
    folder = os.path.join(shared_dir, "mixtral")
    logits, tokens = from_rank0(lambda: oracle(folder), world)
    n = world.Get_size()
    serial = loaded(folder, Topology.serial())
    for layout in [dict()] + EXPERT_LAYOUTS.get(n, []):
        topo = Topology.create(world, **layout)
        what = f"tp={topo.tp.size} dp={topo.dp.size} ep={topo.ep.size} etp={topo.etp.size}"
        model = loaded(folder, topo)
        cfg = model.cfg
        assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_router, cfg.moe_topk_norm, cfg.moe_capacity) == \
            (4, 2, "softmax", "sum", 0.0)
        check_shards(model, serial, world)
        held = {int(p.name.split("/")[4]) for p in model.parameters() if "/experts/" in p.name}
        groups = topo.ep.comm.allgather(sorted(held))                   # each expert on one member of the group
        assert sorted(sum(groups, [])) == [0, 1, 2, 3], f"{what}: the ep group holds experts {groups}"
        assert_like_oracle(model, (logits, tokens), PROMPTS, NEW, what, world)
        topo.free()


@needs_oracle
@pytest.mark.mpi(min_size=1)
def test_fused_experts_read_as_the_per_expert_folder(world, shared_dir):  # noqa: F811
    """The same model saved twice by transformers 5, per expert and fused (save_original_format=False): each
    rank reads the same shards from both, so the logits are equal bit for bit, and transformers' from the fused
    folder (at tp = world and, at an even world size, ep 2)."""
    per, fused = (os.path.join(shared_dir, name) for name in ("per-expert", "fused"))

    def make():
        mixtral_folder(per, seed=4)
        mixtral_folder(fused, seed=4, fused=True)
        return greedy_oracle(eager(fused), [], 0, (1, 32))[0]
    logits = from_rank0(make, world)
    with open_checkpoint(fused) as f, open_checkpoint(per) as p:
        assert f.fused and not p.fused and "model.layers.1.mlp.experts.gate_up_proj" in f.files
        assert f.cfg == p.cfg
    n = world.Get_size()
    for layout in [dict()] + ([dict(ep=2, etp=n // 2)] if n % 2 == 0 else []):
        topo = Topology.create(world, **layout)
        what = f"tp={n} ep={topo.ep.size}"
        a, b = loaded(per, topo), loaded(fused, topo)
        same = all(np.array_equal(x.data, y.data) for x, y in zip(a.parameters(), b.parameters(), strict=True))
        assert all_true(same, world), f"{what}: a rank's shard from the fused folder differs from the per-expert one"
        for S in (1, 32):
            mine = b.full_logits(IDS[:, :S])
            assert all_true(np.array_equal(mine, a.full_logits(IDS[:, :S])), world), f"{what}: logits at S={S}"
            assert_close(mine, logits[S], LLAMA_TOL, f"fused folder's logits at S={S}, {what}", comm=world)
        topo.free()


@needs_oracle
def test_export_gives_the_folder_back_and_transformers_loads_it(tmp_path):
    import torch
    from safetensors.numpy import load_file
    from mpi4py import MPI

    from mpi_tp.checkpoint import Checkpoint
    from mpi_tp.commands.hf import import_folder
    src, out = str(tmp_path / "mixtral"), str(tmp_path / "out")
    mixtral_folder(src, seed=5)
    with Checkpoint(import_folder(src, str(tmp_path / "imported"), MPI.COMM_SELF)) as ck:    # import, export
        export(ck, out)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)       # bit for bit
    with torch.no_grad():
        want, got = (m(torch.tensor(IDS[:, :9])).logits.numpy() for m in (eager(src), eager(out)))
    assert np.array_equal(want, got)


NATIVE = {"topk-softmax-k2-tied": dict(moe_router="topk-softmax", tie_word_embeddings=True),
          "softmax-sum-k1": dict(moe_top_k=1, moe_topk_norm="sum", moe_z_weight=0.1, moe_aux_weight=0.05)}


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("variant", list(NATIVE))
def test_moe_made_here_exported_gives_transformers_our_logits(world, shared_dir, variant):  # noqa: F811
    """A llama mixture of experts built in mpi_tp (random weights, the same at every size), saved at tp = world
    and exported: transformers computes its logits (Mixtral's router is the topk-softmax one, and the softmax
    one with normalised gates; at k = 1 a gate of 1; the aux and z weights are training only)."""
    from mpi_tp.checkpoint import save
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.model.gpt import GPT
    cfg = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=6, n_embd=24, arch="llama", n_kv_head=3,
                    intermediate_size=20, rope_theta=1000.0, norm_eps=1e-6, **{"moe_experts": 4, "moe_top_k": 2,
                                                                               **NATIVE[variant]})
    model = GPT(cfg, Topology.create(world), dtype="float64").eval()
    rng = np.random.default_rng(3)
    for p in model.parameters():                 # every rank draws every full tensor, keeps its slice
        p.data[...] = (1.0 if "ln" in p.name else 0.0) + 0.2 * rng.standard_normal(p.global_shape)[p.index()]
    root, out = os.path.join(shared_dir, "native"), os.path.join(shared_dir, "native-hf")
    save(root, 0, model, None, {"config": cfg.to_dict()})
    mine = model.full_logits(IDS)

    def theirs():
        import torch
        with open_checkpoint(root) as ck:
            export(ck, out)
        hf = eager(out)
        assert type(hf).__name__ == "MixtralForCausalLM" and hf.config.num_experts_per_tok == cfg.moe_top_k
        with torch.no_grad():
            return hf(torch.tensor(IDS)).logits.numpy()
    assert_close(mine, from_rank0(theirs, world), LLAMA_TOL, f"{variant} exported at tp={world.Get_size()}",
                 comm=world)


def _exported(tmp_path, **cfg):
    """A one-rank mpi_tp Mixtral-like checkpoint with these config changes, exported (raises what export says)."""
    from dataclasses import replace

    from mpi_tp.checkpoint import save
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.model.gpt import GPT
    base = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=8, arch="llama", moe_experts=4,
                     moe_top_k=2)
    model = GPT(replace(base, **cfg), Topology.serial(), dtype="float32")
    step = save(str(tmp_path / "ck"), 1, model, meta={"config": model.cfg.to_dict()})
    with open_checkpoint(step) as ck:
        return export(ck, str(tmp_path / "hf"))


@pytest.mark.parametrize("cfg, says", [
    (dict(moe_shared_experts=1), "shared experts"),
    (dict(moe_router="sigmoid"), "the sigmoid router"),
    (dict(moe_topk_norm="none"), "gates not divided by their sum"),
    (dict(moe_capacity=1.0), "a capacity (1) that drops assignments"),
    (dict(moe_every=2), "moe_every = 2"),
    (dict(arch="gpt2"), "GPT-2 MLPs"),
    (dict(moe_gate_scale=2.5), "gates scaled by 2.5"),
    (dict(moe_top_k=1), "gates not divided by their sum"),          # auto at k = 1: the gate is the probability
])
def test_what_mixtral_cannot_compute_is_refused_in_one_line(tmp_path, cfg, says):
    pytest.importorskip("safetensors")
    with pytest.raises(CheckpointError, match="MixtralForCausalLM cannot compute") as e:
        _exported(tmp_path, **cfg)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "hf")


@needs_oracle
@pytest.mark.parametrize("overrides, says", [
    (dict(router_jitter_noise=0.1), "router_jitter_noise = 0.1 is not supported"),
])
def test_what_mpi_tp_cannot_import_is_refused_in_one_line(tmp_path, overrides, says):
    folder = str(tmp_path / "m")
    mixtral_folder(folder, **overrides)
    with pytest.raises(UserError, match=says):
        open_checkpoint(folder)
