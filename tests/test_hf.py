"""Hugging Face GPT-2 and Llama folders against transformers itself.

GPT-2: the same logits (float64, < 1e-9) from the folder and from its import at every tensor-parallel
size of the pass (5 heads and vocabulary 97: uneven at 2, 3 and 4 ranks; the MLP's 80 columns at 3, a
50-wide n_inner at 3 and 4), the same greedy tokens, a checkpoint trained at tp 2 x dp 2 and exported
that transformers loads with mpi_tp's loss (tests/test_hf_cli.py, with the other commands). Llama (grouped-query attention: 6 query heads over 3 or 2
key/value heads, split at 2 and 3 ranks, replicated at 4; tied and untied): each rank's shard is its
slice of the folder's (transposed) tensor, the logits equal the serial model's (< 1e-10) and
transformers' to float32's rounding (< 1e-6: transformers computes RMSNorm and the rotary angles in
float32 whatever the model's dtype), and within 1e-9 of transformers with those two steps in float64
(float64_llama: the oracle made stricter, its own code otherwise); a trained Llama checkpoint exported
loads in transformers, which computes mpi_tp's loss (float64 steps: 1e-9).
And one line for each model mpi_tp does not compute.

The oracle (transformers and torch, `pip install -e '.[hf-oracle]'`) runs on rank 0 only; without it those
tests skip and the rest (folders written here with safetensors alone: round trips, bfloat16, refusals)
still run. Without safetensors (the `hf` extra) the whole module skips.
"""
import contextlib
import importlib.util
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
from jobs import MPIEXEC  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from mpi_tp import checkpoint as ck  # noqa: E402
from mpi_tp.checkpoint.hf import hf_config  # noqa: E402
from mpi_tp.checkpoint.hf.names import hf_shapes  # noqa: E402
from mpi_tp.commands.hf import import_folder  # noqa: E402
from mpi_tp.core.errors import UserError  # noqa: E402
from mpi_tp.core.testing import all_true, assert_close, from_rank0  # noqa: E402
from mpi_tp.inference.generate import Request, generate  # noqa: E402
from mpi_tp.model.config import GPTConfig  # noqa: E402
from mpi_tp.model.gpt import GPT  # noqa: E402
from mpi_tp.parallel.topology import Topology  # noqa: E402

ORACLE = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
needs_oracle = pytest.mark.skipif(not ORACLE, reason="the transformers oracle is not installed "
                                  "(pip install -e '.[hf-oracle]': transformers, torch==2.13.0 CPU build)")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
SIZES = dict(vocab_size=97, n_positions=32, n_embd=20, n_layer=2, n_head=5)     # uneven at 2, 3, 4 ranks
LLAMA_SIZES = dict(vocab_size=97, max_position_embeddings=32, hidden_size=24, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=3, intermediate_size=40, rope_theta=500.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=False)
CFG = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=5, n_embd=20)
LLAMA = GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=6, n_embd=24, arch="llama", n_kv_head=3,
                  intermediate_size=40, rope_theta=500.0, norm_eps=1e-6, tie_word_embeddings=False)
TOL = 1e-9
LLAMA_TOL = 1e-6          # transformers' Llama: RMSNorm and rotary angles in float32 (see the docstring)


@contextlib.contextmanager
def float64_llama():
    """transformers' Llama with its two float32 steps in float64: RMSNorm (it casts to float32) and the
    rotary angles (inv_freq made in float32). Everything else is transformers' own code."""
    import torch
    from transformers.models.llama import modeling_llama as m

    def norm(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rope(self, x, position_ids):
        c = self.config
        dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        inv = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        emb = torch.cat([position_ids[..., None].double() * inv] * 2, dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    saved = m.LlamaRMSNorm.forward, m.LlamaRotaryEmbedding.forward
    m.LlamaRMSNorm.forward, m.LlamaRotaryEmbedding.forward = norm, rope
    try:
        yield
    finally:
        m.LlamaRMSNorm.forward, m.LlamaRotaryEmbedding.forward = saved


# ---------------------------------------------------------------- folders

def transformers_folder(path, shard_kb=None, seed=0, arch="gpt2", **overrides):
    """A random-weight GPT2LMHeadModel (or LlamaForCausalLM) in float64 saved by save_pretrained (sharded
    under shard_kb); every parameter moved off its initial value (biases and norms too), so each mapping is
    exercised. overrides: config.json's settings."""
    import torch
    import transformers
    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(**{**LLAMA_SIZES, **overrides}, bos_token_id=None, eos_token_id=None)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(**{**SIZES, **overrides}, bos_token_id=None, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(config)
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, **({"max_shard_size": f"{shard_kb}KB"} if shard_kb else {}))
    return model


def numpy_folder(path, cfg=CFG, config=None, tensors=None, seed=0, dtype=np.float64):
    """A GPT-2 folder written with safetensors alone (no torch): random tensors of the shapes config.json
    implies; `config` and `tensors` override config.json's keys and the tensors (None: leave it out)."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    values = {k: (0.3 * rng.standard_normal(s)).astype(dtype) for k, s in hf_shapes(cfg).items()}
    for k, v in (tensors or {}).items():
        if v is None:
            values.pop(k)
        else:
            values[k] = v
    save_file(values, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**hf_config(cfg, np.dtype(dtype).name), **(config or {})}, f)
    return values


def write_bf16(path, arrays):
    """A safetensors file of bfloat16 tensors, written by hand (NumPy has no bfloat16): float32 values
    rounded toward zero to their upper 16 bits. Returns those values as float32."""
    header, blobs, at, exact = {}, [], 0, {}
    for name, a in arrays.items():
        bits = (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")
        exact[name] = (bits.astype(np.uint32) << 16).view(np.float32)
        blobs.append(bits.tobytes())
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [at, at + len(blobs[-1])]}
        at += len(blobs[-1])
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    return exact


@pytest.fixture
def shared_dir(world):
    """One temporary folder that every rank sees (rank 0 makes it and removes it)."""
    path = world.bcast(tempfile.mkdtemp(prefix="mpi_tp_hf_") if world.Get_rank() == 0 else None)
    yield path
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def loaded(path, topo, dtype="float64"):
    with ck.open_checkpoint(path) as c:
        model = GPT(GPTConfig(**c.meta["config"]), topo, dtype=dtype).eval()
        ck.load_into(c, model)
    return model


IDS = np.random.default_rng(7).integers(0, 97, (3, 32))
LENGTHS = (1, 2, 3, 4, 17, 32)                  # 32 = n_positions: every row of wpe


def oracle_logits(model, lengths=LENGTHS):
    import torch
    with torch.no_grad():
        return {S: model(torch.tensor(IDS[:, :S])).logits.numpy() for S in lengths}


def random_transformers_folder(path, kind: str, sizes: dict, seed: int, eager: bool = False):
    """A random-weight transformers {kind}ForCausalLM of config `sizes` in float64, saved by save_pretrained
    (weights moved off their initialisation by 0.1 randn; eager: the eager attention, which applies a sliding
    window); returns the model, the oracle."""
    import torch
    import transformers
    torch.manual_seed(seed)
    config = getattr(transformers, f"{kind}Config")(**sizes, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if eager:
        config._attn_implementation = "eager"
    model = getattr(transformers, f"{kind}ForCausalLM")(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def assert_like_oracle(model, oracle, prompts, new, what, world, ids=None):
    """mpi_tp's model against greedy_oracle's (logits, tokens): its logits at each of the oracle's lengths within
    LLAMA_TOL (transformers' float32 steps) and its greedy continuations of `prompts` the oracle's, on every rank."""
    logits, tokens = oracle
    ids = IDS if ids is None else ids
    for S in sorted(logits):
        assert_close(model.full_logits(ids[:, :S]), logits[S], LLAMA_TOL, f"logits at S={S}, {what}", comm=world)
    got = generate(model, [Request(tuple(p.tolist()), new, temperature=0.0) for p in prompts])
    assert all_true([list(g) for g in got] == tokens, world), f"greedy tokens differ from transformers, {what}"


def greedy_oracle(model, prompts, new, lengths):
    """(logits at each of `lengths`, greedy continuations of `prompts`): a transformers model, the oracle."""
    import torch
    with torch.no_grad():
        logits = {S: model(torch.tensor(IDS[:, :S])).logits.numpy() for S in lengths}
    tokens = [model.generate(torch.tensor(p[None]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
              for p in prompts]
    return logits, tokens


def check_shards(model, serial, world):
    """Each rank's shard is its slice of the whole tensor (the serial model's, read from the same folder)."""
    whole = {p.name: p.data for p in serial.parameters()}
    ok = all(np.array_equal(p.data, whole[p.name][p.index()]) for p in model.parameters())
    assert all_true(ok, world), "a rank's shard is not its slice of the folder's tensor"


# ---------------------------------------------------------------- against transformers, at the pass's size

GPT2_VARIANTS = {"one-file": (None, {}), "sharded": (20, {}),
                 "n_inner-eps": (None, {"n_inner": 50, "layer_norm_epsilon": 1e-6})}


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("variant", list(GPT2_VARIANTS))
def test_logits_from_folder_equal_transformers(world, shared_dir, variant):
    shard_kb, overrides = GPT2_VARIANTS[variant]
    folder = os.path.join(shared_dir, "gpt2")
    ref = from_rank0(lambda: oracle_logits(transformers_folder(folder, shard_kb, **overrides)), world)
    files = sorted(os.listdir(folder))
    assert ("model.safetensors.index.json" in files) == bool(shard_kb), files
    model = loaded(folder, Topology.create(world))
    check_shards(model, loaded(folder, Topology.serial()), world)
    for S in LENGTHS:
        assert_close(model.full_logits(IDS[:, :S]), ref[S], TOL, f"logits at S={S}, tp={world.Get_size()}",
                     scale=1.0, comm=world)


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kv, tied", [(3, False), (2, True)], ids=["K3-untied", "K2-tied"])
def test_llama_logits_from_folder(world, shared_dir, kv, tied):
    folder = os.path.join(shared_dir, "llama")

    def oracle():
        hf = transformers_folder(folder, 20, arch="llama", num_key_value_heads=kv, tie_word_embeddings=tied)
        with float64_llama():
            strict = oracle_logits(hf, (1, 3, 32))
        return oracle_logits(hf, (1, 3, 32)), strict
    ref, strict = from_rank0(oracle, world)
    model, serial = loaded(folder, Topology.create(world)), loaded(folder, Topology.serial())
    assert model.cfg.llama and model.cfg.kv_heads == kv and model.cfg.tied == tied
    assert ("lm_head" in {p.name for p in serial.parameters()}) != tied
    check_shards(model, serial, world)
    for S in (1, 3, 32):
        logits = model.full_logits(IDS[:, :S])
        assert_close(logits, serial.full_logits(IDS[:, :S]), 1e-10, f"tp={world.Get_size()} against tp=1, S={S}",
                     scale=1.0, comm=world)
        assert_close(logits, ref[S], LLAMA_TOL, f"against transformers, S={S}", comm=world)
        assert_close(logits, strict[S], TOL, f"against transformers in float64 throughout, S={S}", comm=world)


@needs_oracle
@pytest.mark.mpi(min_size=1)
def test_import_hf_equals_transformers_at_any_layout(world, shared_dir):
    folder, out = os.path.join(shared_dir, "gpt2"), os.path.join(shared_dir, "imported")
    ref = from_rank0(lambda: oracle_logits(transformers_folder(folder, 20)), world)
    step = import_folder(folder, out, world)
    with ck.Checkpoint(out) as c:
        assert c.dir == step and c.step == 0 and len(c.shards) == world.Get_size() and not c.has_optimizer
        assert c.meta["config"] == CFG.to_dict() | {"dropout": 0.1} and c.meta["dtypes"] == "float64"
    for topo in (Topology.create(world), Topology.serial()):  # at the import's size, and at tp = 1
        model = loaded(out, topo)
        for S in (1, 4, 32):
            assert_close(model.full_logits(IDS[:, :S]), ref[S], TOL, f"imported, tp={topo.tp.size}, S={S}",
                         scale=1.0, comm=world)
    with pytest.raises(UserError, match="exists already"):       # on every rank, with one message
        import_folder(folder, out, world)


@needs_oracle
@pytest.mark.mpi(min_size=1)
def test_greedy_generation_equals_transformers(world, shared_dir):
    folder = os.path.join(shared_dir, "gpt2")
    prompts = [IDS[0, :5], IDS[1, :1], IDS[2, :12]]
    new = 14

    def oracle():
        import torch
        model = transformers_folder(folder, seed=3)
        # an explicit mask: without one, generate takes every pad_token_id in a prompt for padding
        return [model.generate(torch.tensor(p[None]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    ref = from_rank0(oracle, world)
    model = loaded(folder, Topology.create(world))
    got = generate(model, [Request(bytes(p.tolist()), new, temperature=0.0) for p in prompts])
    assert [list(g) for g in got] == ref
