"""Hugging Face folders written with safetensors alone (no torch): a folder -> an import at the pass's size ->
an export gives the same tensors bit for bit, bfloat16 is read exactly, the original gpt2 release's names and
buffers are understood, and every model mpi_tp does not compute is one line. Folders are test_hf's."""
import json
import os
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
from safetensors.numpy import save_file  # noqa: E402
from test_hf import CFG, LLAMA, loaded, numpy_folder, shared_dir, write_bf16  # noqa: E402,F401

from mpi_tp import checkpoint as ck  # noqa: E402
from mpi_tp.checkpoint.hf import HFConfigError, HFFolder, export, hf_config  # noqa: E402,F401
from mpi_tp.checkpoint.hf.names import hf_shapes  # noqa: E402
from mpi_tp.commands.hf import import_folder  # noqa: E402
from mpi_tp.core.errors import UserError  # noqa: E402
from mpi_tp.core.testing import all_true  # noqa: E402


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cfg", [CFG, LLAMA, replace(LLAMA, n_kv_head=1, tie_word_embeddings=True)],
                         ids=["gpt2", "llama", "llama-K1-tied"])
def test_numpy_folder_round_trip(world, shared_dir, cfg):  # noqa: F811 (the fixture)
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
        assert f.meta["dtypes"] == "bfloat16"                       # the folder's format: read as it is stored
        q = f.read("model/h/1/attn/k/weight", 1, 4, 12)               # columns [C + 4, C + 12) of c_attn
        assert q.dtype.name == "bfloat16"
        assert np.array_equal(q.astype(np.float32), exact["transformer.h.1.attn.c_attn.weight"][:, 24:32])
        assert np.array_equal(f.read("model/wte", 0, 50, 97).astype(np.float32), exact["transformer.wte.weight"][50:])


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
    ({"model_type": "phi3"}, "model_type 'phi3'"),
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


def refused(tmp_path, message, cfg=CFG, error=UserError, **folder):
    """A folder of cfg's model with `folder`'s changes (numpy_folder's config or tensors) is refused: one
    line holding message."""
    numpy_folder(str(tmp_path / "m"), cfg, **folder)
    with pytest.raises(error) as e:
        HFFolder(str(tmp_path / "m"))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("config, message", REFUSED_CONFIGS, ids=[m for _, m in REFUSED_CONFIGS])
def test_unsupported_config_is_one_line(tmp_path, config, message):
    refused(tmp_path, message, config=config)


@pytest.mark.parametrize("config, message", REFUSED_LLAMA, ids=[m for _, m in REFUSED_LLAMA])
def test_unsupported_llama_config_is_one_line(tmp_path, config, message):
    refused(tmp_path, message, LLAMA, config=config)


def test_llama_bias_where_none_is_expected(tmp_path):
    numpy_folder(str(tmp_path / "m"), LLAMA, tensors={"model.layers.1.self_attn.q_proj.bias": np.zeros(24)})
    with pytest.raises(HFConfigError, match="holds model.layers.1.self_attn.q_proj.bias, which mpi_tp's llama "
                                            "model has no place for"):
        HFFolder(str(tmp_path / "m"))


@pytest.mark.parametrize("tensors, message", REFUSED_TENSORS, ids=[m for _, m in REFUSED_TENSORS])
def test_unexpected_tensors_are_one_line(tmp_path, tensors, message):
    refused(tmp_path, message, error=HFConfigError, tensors=tensors)


def test_pytorch_bin_only_is_one_line(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(CFG, "float32")))
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(UserError, match="pytorch_model.bin: mpi_tp reads only safetensors"):
        ck.open_checkpoint(str(folder))
