"""What a Mixtral folder or export cannot be, each one line; and what it may be (safetensors alone, no torch).

Import: a Mixtral config.json whose model mpi_tp does not compute (k > E, no experts, a negative aux weight, a
classifier's architecture, a window that is no integer) is refused by name; the settings that change
nothing (a window at least max_position_embeddings long, a jitter of 0, output_router_logits) are accepted,
and a missing rope_theta or router_aux_loss_coef means MixtralConfig's defaults. An expert tensor missing,
one past num_local_experts, or a fused expert tensor of the wrong shape is one line naming it. Export: an
expert bias that training moved (the other MoE forms Mixtral lacks are test_hf_mixtral's) is refused with
why, leaving nothing behind; a zero bias and the training-only weights export. The mpi-tp commands say
either in one line.

    python -m pytest -q tests/test_hf_mixtral_refusals.py
"""
import json
import os
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
from jobs import mpirun  # noqa: E402
from test_hf import needs_mpiexec, numpy_folder  # noqa: E402

from mpi_tp import checkpoint as ck  # noqa: E402
from mpi_tp.checkpoint.format import CheckpointError  # noqa: E402
from mpi_tp.checkpoint.hf import HFFolder, export, hf_config  # noqa: E402
from mpi_tp.core.errors import UserError  # noqa: E402
from mpi_tp.model.config import GPTConfig  # noqa: E402
from mpi_tp.model.gpt import GPT  # noqa: E402
from mpi_tp.parallel.topology import Topology  # noqa: E402

# as an import reads a Mixtral: the softmax router with its k gates divided by their sum, dropless, every block
MOE = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=16, arch="llama", n_kv_head=2,
                intermediate_size=24, tie_word_embeddings=False, moe_experts=3, moe_top_k=2, moe_router="softmax",
                moe_topk_norm="sum", moe_aux_weight=0.02)

REFUSED_IMPORT = [
    ({"num_experts_per_tok": 4}, "num_experts_per_tok = 4 exceeds num_local_experts = 3"),
    ({"num_local_experts": 0}, "num_local_experts = 0: config.json needs a positive integer"),
    ({"output_router_logits": True, "router_aux_loss_coef": -1}, "router_aux_loss_coef = -1: config.json needs"),
    ({"architectures": ["MixtralForSequenceClassification"]}, "['MixtralForSequenceClassification'] are not"),
    ({"sliding_window": "8"}, "sliding_window = '8': config.json needs a positive integer or null"),
]


@pytest.mark.parametrize("config, message", REFUSED_IMPORT, ids=[m.split(":")[0] for _, m in REFUSED_IMPORT])
def test_unsupported_mixtral_config_is_one_line(tmp_path, config, message):
    numpy_folder(str(tmp_path / "m"), MOE, config=config, dtype=np.float32)
    with pytest.raises(UserError) as e:
        HFFolder(str(tmp_path / "m"))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("config", [{"sliding_window": 16}, {"sliding_window": None}, {"router_jitter_noise": 0},
                                    {}], ids=["window-16", "window-null", "jitter-0", "as-exported"])
def test_settings_that_change_nothing_are_accepted(tmp_path, config):
    numpy_folder(str(tmp_path / "m"), MOE, config=config, dtype=np.float32)
    with HFFolder(str(tmp_path / "m")) as f:
        assert f.cfg == MOE and not f.fused


def test_mixtral_defaults(tmp_path):
    """A config.json without rope_theta (nor rope_parameters) or router_aux_loss_coef: MixtralConfig's defaults
    (1e6 and 0.001), not Llama's 10000; without output_router_logits the aux weight is 0 (training only)."""
    folder = tmp_path / "m"
    numpy_folder(str(folder), MOE, dtype=np.float32)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "router_aux_loss_coef"):
        config.pop(key)
    (folder / "config.json").write_text(json.dumps(config))
    with HFFolder(str(folder)) as f:
        assert f.cfg.rope_theta == 1e6 and f.cfg.moe_aux_weight == 0.001
    (folder / "config.json").write_text(json.dumps({**config, "output_router_logits": False}))
    with HFFolder(str(folder)) as f:
        assert f.cfg.moe_aux_weight == 0.0


def test_expert_tensors_checked(tmp_path):
    """An expert missing, one more than num_local_experts, a fused tensor of E - 1 experts: one line naming it."""
    block = "model.layers.1.block_sparse_moe"
    numpy_folder(str(tmp_path / "a"), MOE, tensors={f"{block}.experts.2.w3.weight": None}, dtype=np.float32)
    with pytest.raises(UserError, match=f"lacks {block}.experts.2.w3.weight: its config.json"):
        HFFolder(str(tmp_path / "a"))
    numpy_folder(str(tmp_path / "b"), MOE, tensors={f"{block}.experts.3.w1.weight": np.zeros((24, 16), np.float32)},
                 dtype=np.float32)
    with pytest.raises(UserError, match=f"holds {block}.experts.3.w1.weight, which"):
        HFFolder(str(tmp_path / "b"))
    names = numpy_folder(str(tmp_path / "c"), MOE, dtype=np.float32)
    per_expert = {n: None for n in names if ".block_sparse_moe." in n}          # left out: the fused ones instead
    rng, experts = np.random.default_rng(1), "model.layers.0.mlp.experts"
    fused = {f"model.layers.{i}.mlp.{name}": rng.standard_normal(shape).astype(np.float32) for i in range(2)
             for name, shape in (("gate.weight", (3, 16)), ("experts.gate_up_proj", (3, 48, 16)),
                                 ("experts.down_proj", (3, 16, 24)))}
    numpy_folder(str(tmp_path / "c"), MOE, tensors={**per_expert, **fused}, dtype=np.float32)
    with HFFolder(str(tmp_path / "c")) as f:                   # up is rows F:2F of gate_up_proj[e], transposed
        assert f.fused and np.array_equal(f.read("model/h/1/moe/experts/2/up/weight", 1, 5, 9),
                                          fused["model.layers.1.mlp.experts.gate_up_proj"][2, 29:33].T)
    wrong = {f"{experts}.down_proj": np.zeros((2, 16, 24), np.float32)}
    numpy_folder(str(tmp_path / "d"), MOE, tensors={**per_expert, **fused, **wrong}, dtype=np.float32)
    with pytest.raises(UserError, match=rf"{experts}.down_proj is \(2, 16, 24\), but its config.json makes it "
                                        rf"\(3, 16, 24\)"):
        HFFolder(str(tmp_path / "d"))


def saved(tmp_path, cfg, bias=False):
    """A one-rank checkpoint of a random mpi_tp model of cfg (bias: block 1's expert bias moved off 0)."""
    model = GPT(cfg, Topology.serial(), dtype="float32")
    if bias:
        model.h[1].mlp.expert_bias.data[...] = [0.0, 0.25, 0.0]
    root = str(tmp_path / "ckpt")
    ck.save(root, 0, model, None, {"config": cfg.to_dict()})
    return root


def test_export_refuses_an_expert_bias_that_training_moved(tmp_path):
    """The aux-loss-free balance's bias steers the choice; Mixtral's router has none: refused, naming it, and
    nothing left behind (the other MoE forms Mixtral lacks: test_hf_mixtral)."""
    root, out = saved(tmp_path, replace(MOE, moe_bias_rate=0.001), bias=True), str(tmp_path / "hf")
    with ck.Checkpoint(root) as c, pytest.raises(CheckpointError) as e:
        export(c, out)
    says = "MixtralForCausalLM cannot compute: its router carries an expert bias (model/h/1/moe/router/expert_bias"
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def test_export_keeps_a_zero_bias_and_training_settings(tmp_path):
    """moe_bias_rate with the bias still 0, a z-loss weight, Mixtral's topk-softmax router: the model is
    Mixtral's, exported (the z weight is training only and Mixtral has none: not written), read back as an
    import reads Mixtral's router."""
    cfg = replace(MOE, moe_bias_rate=0.001, moe_z_weight=0.1, moe_router="topk-softmax", moe_topk_norm="auto")
    with ck.Checkpoint(saved(tmp_path, cfg)) as c:
        export(c, str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == hf_config(cfg, "float32") and config["architectures"] == ["MixtralForCausalLM"]
    assert {k: config[k] for k in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef")} == \
        {"num_local_experts": 3, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
    with HFFolder(str(tmp_path / "hf")) as f:
        assert f.cfg == MOE


@needs_mpiexec
def test_commands_say_it_in_one_line(tmp_path):
    folder = str(tmp_path / "m")
    numpy_folder(folder, MOE, dtype=np.float32)
    r = mpirun(2, "import-hf", folder, str(tmp_path / "imported"))
    assert r.returncode == 0 and "tp=2" in r.stdout, r.stderr
    r = mpirun(1, "export", str(tmp_path / "imported"), str(tmp_path / "back"), "--format", "hf")
    assert r.returncode == 0 and "MixtralForCausalLM" in r.stdout, r.stderr
    numpy_folder(str(tmp_path / "bad"), MOE, config={"router_jitter_noise": 0.01}, dtype=np.float32)
    r = mpirun(2, "import-hf", str(tmp_path / "bad"), str(tmp_path / "x"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "router_jitter_noise = 0.01" in r.stderr, r.stderr
    r = mpirun(1, "export", saved(tmp_path, replace(MOE, moe_capacity=1.0)), str(tmp_path / "y"), "--format", "hf")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "drops assignments" in r.stderr, r.stderr
