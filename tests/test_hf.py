"""Hugging Face GPT-2 and Llama folders against transformers itself.

GPT-2: the same logits (float64, < 1e-9) from the folder and from its import at every tensor-parallel
size of the pass (5 heads and vocabulary 97: uneven at 2, 3 and 4 ranks; the MLP's 80 columns at 3, a
50-wide n_inner at 3 and 4), the same greedy tokens, a checkpoint trained at tp 2 x dp 2 and exported
that transformers loads with mpi_tp's loss. Llama (grouped-query attention: 6 query heads over 3 or 2
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
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
from safetensors.numpy import save_file  # noqa: E402
from test_cli import MPIEXEC, mpirun  # noqa: E402

from mpi_tp import checkpoint as ck  # noqa: E402
from mpi_tp.checkpoint.hf import HFConfigError, HFFolder, export, hf_config  # noqa: E402
from mpi_tp.checkpoint.hf.names import hf_shapes  # noqa: E402
from mpi_tp.commands.hf import import_folder  # noqa: E402
from mpi_tp.core.errors import UserError  # noqa: E402
from mpi_tp.core.testing import all_true, assert_close  # noqa: E402
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
    ref = world.bcast(oracle_logits(transformers_folder(folder, shard_kb, **overrides))
                      if world.Get_rank() == 0 else None)
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
    ref, strict = world.bcast(oracle() if world.Get_rank() == 0 else None)
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
    ref = world.bcast(oracle_logits(transformers_folder(folder, 20)) if world.Get_rank() == 0 else None)
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
    ref = world.bcast(oracle() if world.Get_rank() == 0 else None)
    model = loaded(folder, Topology.create(world))
    got = generate(model, [Request(bytes(p.tolist()), new, temperature=0.0) for p in prompts])
    assert [list(g) for g in got] == ref


# ---------------------------------------------------------------- with safetensors alone

@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cfg", [CFG, LLAMA, replace(LLAMA, n_kv_head=1, tie_word_embeddings=True)],
                         ids=["gpt2", "llama", "llama-K1-tied"])
def test_numpy_folder_round_trip(world, shared_dir, cfg):
    """A folder -> an import at this size -> export -> the same tensors, bit for bit (one file and shards);
    with K = 1 every rank holds a replica of the key/value head, written once."""
    folder, out = os.path.join(shared_dir, "np"), os.path.join(shared_dir, "imported")
    values = world.bcast(numpy_folder(folder, cfg) if world.Get_rank() == 0 else None)
    world.Barrier()
    import_folder(folder, out, world)
    ok = True
    if world.Get_rank() == 0:
        for limit, files in ((10**9, ["config.json", "model.safetensors"]), (20_000, None)):
            back = os.path.join(shared_dir, f"back-{limit}")
            with ck.Checkpoint(out) as c:
                written = export(c, back, max_shard_bytes=limit)
            assert files is None or sorted(written) == files
            assert files is not None or "model.safetensors.index.json" in written and len(written) > 3
            with HFFolder(back) as f:
                assert f.cfg == HFFolder(folder).cfg
                from safetensors import safe_open
                for name, v in values.items():
                    with safe_open(os.path.join(back, f.files[name].split(os.sep)[-1]), "np") as g:
                        ok &= np.array_equal(g.get_tensor(name), v)
    assert all_true(ok, world), "an exported tensor differs from the folder's"


def test_bfloat16_read_exactly(tmp_path):
    folder = str(tmp_path / "bf16")
    numpy_folder(folder, dtype=np.float32)
    rng = np.random.default_rng(1)
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in hf_shapes(CFG).items()}
    exact = write_bf16(os.path.join(folder, "model.safetensors"), arrays)
    with HFFolder(folder) as f:
        assert f.meta["dtypes"] == "float32"
        q = f.read("model/h/1/attn/k/weight", 1, 4, 12)               # columns [C + 4, C + 12) of c_attn
        assert np.array_equal(q, exact["transformer.h.1.attn.c_attn.weight"][:, 24:32])
        assert np.array_equal(f.read("model/wte", 0, 50, 97), exact["transformer.wte.weight"][50:])


def test_original_gpt2_names_and_buffers(tmp_path):
    """The original gpt2 release's model.safetensors: no 'transformer.' prefix, and the attention's
    causal-mask buffers h.N.attn.bias saved beside the weights (not parameters: ignored)."""
    folder = str(tmp_path / "gpt2")
    values = numpy_folder(folder)
    bare = {k[len("transformer."):]: v for k, v in values.items()}
    bare.update({f"h.{n}.attn.bias": np.tril(np.ones((1, 1, 32, 32))) for n in range(2)})
    save_file(bare, os.path.join(folder, "model.safetensors"))
    with HFFolder(folder) as f:
        assert f.prefix == ""
        assert np.array_equal(f.read("model/h/0/attn/v/bias"), values["transformer.h.0.attn.c_attn.bias"][40:])
        assert np.array_equal(f.read("model/h/1/mlp/proj/weight", 0, 3, 9),
                              values["transformer.h.1.mlp.c_proj.weight"][3:9])


REFUSED_CONFIGS = [
    ({"model_type": "mistral"}, "model_type 'mistral'"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"activation_function": "gelu"}, "activation_function 'gelu'"),
    ({"layer_norm_epsilon": -1}, "layer_norm_epsilon = -1"),
    ({"scale_attn_weights": False}, "scale_attn_weights = false"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx = true"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn = true"),
    ({"add_cross_attention": True}, "add_cross_attention = true"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings = false"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"architectures": ["GPT2DoubleHeadsModel"]}, "GPT2DoubleHeadsModel"),
    ({"n_head": 3}, "n_head = 3 must divide n_embd = 20"),
]
REFUSED_LLAMA = [
    ({"hidden_act": "gelu"}, "hidden_act = \"gelu\""),
    ({"attention_bias": True}, "attention_bias = true"),
    ({"mlp_bias": True}, "mlp_bias = true"),
    ({"pretraining_tp": 2}, "pretraining_tp = 2"),
    ({"head_dim": 8}, "head_dim = 8"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters"),
    ({"num_key_value_heads": 4}, "n_kv_head = 4 must be a positive integer dividing n_head = 6"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
]
REFUSED_TENSORS = [
    ({"transformer.h.0.mlp.c_fc.extra_bias": np.zeros(80)}, "holds transformer.h.0.mlp.c_fc.extra_bias"),
    ({"transformer.ln_f.bias": None}, "lacks transformer.ln_f.bias"),
    ({"transformer.wpe.weight": np.zeros((16, 20))}, "transformer.wpe.weight is (16, 20)"),
    ({"transformer.wte.weight": np.zeros((97, 20), dtype=np.int32)}, "is I32"),
]


@pytest.mark.parametrize("config, message", REFUSED_CONFIGS, ids=[m for _, m in REFUSED_CONFIGS])
def test_unsupported_config_is_one_line(tmp_path, config, message):
    numpy_folder(str(tmp_path / "m"), config=config)
    with pytest.raises(UserError) as e:
        HFFolder(str(tmp_path / "m"))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("config, message", REFUSED_LLAMA, ids=[m for _, m in REFUSED_LLAMA])
def test_unsupported_llama_config_is_one_line(tmp_path, config, message):
    numpy_folder(str(tmp_path / "m"), LLAMA, config=config)
    with pytest.raises(UserError) as e:
        HFFolder(str(tmp_path / "m"))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_llama_bias_where_none_is_expected(tmp_path):
    numpy_folder(str(tmp_path / "m"), LLAMA, tensors={"model.layers.1.self_attn.q_proj.bias": np.zeros(24)})
    with pytest.raises(HFConfigError, match="holds model.layers.1.self_attn.q_proj.bias, which mpi_tp's llama "
                                            "model has no place for"):
        HFFolder(str(tmp_path / "m"))


@pytest.mark.parametrize("tensors, message", REFUSED_TENSORS, ids=[m for _, m in REFUSED_TENSORS])
def test_unexpected_tensors_are_one_line(tmp_path, tensors, message):
    numpy_folder(str(tmp_path / "m"), tensors=tensors)
    with pytest.raises(HFConfigError) as e:
        HFFolder(str(tmp_path / "m"))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_pytorch_bin_only_is_one_line(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(CFG, "float32")))
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UserError, match="pytorch_model.bin: mpi_tp reads only safetensors"):
        ck.open_checkpoint(str(folder))


# ---------------------------------------------------------------- the commands (they start their own jobs)

def text_below(tmp_path, vocab=97, n=3000):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(32 + (i * 7919) % (vocab - 32) for i in range(n)))
    return str(path)


@needs_mpiexec
def test_import_hf_eval_generate_and_init_from(tmp_path):
    folder, out, text = str(tmp_path / "gpt2"), str(tmp_path / "imported"), text_below(tmp_path)
    numpy_folder(folder)
    r = mpirun(3, "import-hf", folder, out)
    assert r.returncode == 0 and "step-00000000" in r.stdout, r.stderr
    evals = []
    for n, source in ((1, folder), (2, out)):
        r = mpirun(n, "eval", "--checkpoint", source, "--data", text, "--json")
        assert r.returncode == 0, r.stderr
        evals.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert abs(evals[0]["loss"] - evals[1]["loss"]) < 1e-12 and evals[0]["dtype"] == "float64"
    r = mpirun(2, "eval", "--checkpoint", folder, "--data", "pydoc")           # bytes past the vocabulary
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1 and "97 tokens" in r.stderr
    r = mpirun(2, "generate", "--checkpoint", out, "--prompt", "AB", "--greedy", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    r = mpirun(2, "train", "--init-from", folder, "--data", text, "--steps", "2", "--batch-size", "2",
               "--eval-batches", "1", "--dtype", "float64", "--out", str(tmp_path / "run"))
    assert r.returncode == 0 and "continuing from" in r.stdout, r.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: saved[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")} == \
        dict(vocab_size=97, block_size=32, n_layer=2, n_head=5, n_embd=20)
    r = mpirun(1, "import-hf", str(tmp_path), str(tmp_path / "x"))             # not a model folder
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a Hugging Face model folder" in r.stderr
    numpy_folder(str(tmp_path / "bad"), config={"activation_function": "relu"})
    r = mpirun(2, "eval", "--checkpoint", str(tmp_path / "bad"), "--data", text)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "activation_function 'relu'" in r.stderr


TRAINED = {"gpt2": (["--n-head", "3"], "GPT2LMHeadModel", TOL),
           "llama": (["--arch", "llama", "--n-head", "4", "--n-kv-head", "1"], "LlamaForCausalLM", TOL)}


@needs_mpiexec
def test_train_init_from_a_llama_folder(tmp_path):
    """The folder's model becomes the run's (arch, grouped-query heads, width, rope, eps, untied head)."""
    folder = str(tmp_path / "llama")
    numpy_folder(folder, LLAMA)
    r = mpirun(2, "train", "--init-from", folder, "--data", text_below(tmp_path), "--steps", "1", "--batch-size", "2",
               "--eval-batches", "1", "--dtype", "float64", "--out", str(tmp_path / "run"))
    assert r.returncode == 0 and "continuing from" in r.stdout and "no sample" in r.stdout, r.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: saved[k] for k in ("arch", "n_kv_head", "intermediate_size", "rope_theta", "norm_eps",
                                  "untie_embeddings")} == dict(arch="llama", n_kv_head=3, intermediate_size=40,
                                                               rope_theta=500.0, norm_eps=1e-6, untie_embeddings=True)
    r = mpirun(1, "train", "--init-from", folder, "--n-kv-head", "2", "--data", text_below(tmp_path), "--steps",
               "1", "--out", str(tmp_path / "run2"))
    assert r.returncode == 2 and "n_kv_head: checkpoint 3 vs model 2" in r.stderr, r.stderr


@needs_oracle
@needs_mpiexec
@pytest.mark.parametrize("arch", list(TRAINED))
def test_trained_tp2_dp2_exported_loads_in_transformers(tmp_path, arch):
    """Llama: one key/value head, a replica on each tensor-parallel rank (written once)."""
    import torch
    from transformers import AutoModelForCausalLM
    options, kind, tol = TRAINED[arch]
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    r = mpirun(4, "train", "--tp", "2", "--dp", "2", "--dtype", "float64", "--steps", "3", "--n-layer", "2",
               *options, "--n-embd", "24", "--block-size", "16", "--batch-size", "2", "--eval-batches", "1",
               "--sample-len", "0", "--out", run)
    assert r.returncode == 0, r.stderr
    root = os.path.join(run, "checkpoints")
    r = mpirun(1, "export", root, out, "--format", "hf")
    assert r.returncode == 0 and "model.safetensors" in r.stdout and kind in r.stdout, r.stderr
    r = mpirun(1, "export", root, out, "--format", "hf")
    assert r.returncode == 2 and "exists already: pass --overwrite" in r.stderr
    assert mpirun(1, "export", root, out, "--format", "hf", "--overwrite").returncode == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float64 and type(hf).__name__ == kind
    x = np.random.default_rng(0).integers(0, 256, (4, 16))
    with torch.no_grad(), float64_llama():
        out = hf(torch.tensor(x), labels=torch.tensor(x))                      # mean over the targets x[:, 1:]
        logits = out.logits[:, :-1]                                            # float64
        theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.tensor(x[:, 1:]).reshape(-1))
    ours = loaded(root, Topology.serial()).forward(x[:, :-1], x[:, 1:])
    assert abs(theirs.item() - ours) <= tol * abs(ours), (theirs.item(), ours)
    # transformers' own loss takes the logits to float32 first (ForCausalLMLoss): equal to float32's rounding
    assert abs(out.loss.item() - ours) <= 1e-6 * abs(ours), (out.loss.item(), ours)
