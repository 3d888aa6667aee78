"""rope_scaling "dynamic" (NTK) as transformers computes it (issue 42).

The angles against a hand calculation (float64): theta' = theta ((factor L / L0) - (factor - 1)) ^ (hs / (hs - 2)),
L the sequence's length (never below L0) for a whole forward, a prefilled row and a decode step; the configuration
checks; a Hugging Face config imported and exported keeping the type (max_position_embeddings is L0 there); and a
transformers LlamaForCausalLM with max_position_embeddings 16 read at the pass's size (tp = world: 1, 2, 3): its
logits over 40 positions (LLAMA_TOL: transformers computes the angles in float32) and its generate(do_sample=False)
tokens for one prompt shorter than L0 and one longer, each from a fresh start, 40 positions at most (transformers
rotates a batch for its longest row and keeps that length across calls; mpi_tp each row for its own length).

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_rope_dynamic.py     (N = 1 .. 3)
"""
import json
import os

import numpy as np
import pytest
from test_hf import (  # noqa: F401
    IDS,
    LLAMA_SIZES,
    LLAMA_TOL,
    assert_like_oracle,
    loaded,
    needs_oracle,
    shared_dir,
)

from mpi_tp.checkpoint.hf.config import gpt_config, hf_config
from mpi_tp.core import kernels_llama as kl
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.core.testing import assert_close, from_rank0, max_rel_diff
from mpi_tp.inference.decode import Decoder
from mpi_tp.model.rope import Rope, rope_table
from mpi_tp.model.rope_scaling import RopeScalingError, check_rope_scaling
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.config import TrainConfig

DYN = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}


def by_hand(p, L, theta=100.0, factor=2.0, L0=8):
    """Angles (hs = 4) of position p in a sequence of L: theta' = theta (factor max(L, L0) / L0 - (factor - 1))^2."""
    base = theta * (factor * max(L, L0) / L0 - (factor - 1)) ** 2          # hs / (hs - 2) = 2
    return np.array([p, p / base ** 0.5] * 2)                              # inv_freq: 1, theta'^(-1/2)


def test_dynamic_angles_equal_a_hand_calculation():
    # L = 20: theta' = 100 (2 * 20 / 8 - 1)^2 = 1600, inv_freq (1, 1/40); L <= L0 = 8: theta itself
    assert by_hand(5, 20)[1] == 5 / 40 and by_hand(5, 6)[1] == 5 / 10
    cos, sin = kl.rope_tables(np.arange(20), 4, 100.0, np.float64, DYN, lengths=20)
    want = np.array([by_hand(p, 20) for p in range(20)])
    assert np.allclose(cos, np.cos(want), rtol=0, atol=1e-15) and np.allclose(sin, np.sin(want), rtol=0, atol=1e-15)
    rope = Rope(4, 100.0, np.float64, DYN)
    for n in (5, 8, 20):                                      # one forward over n positions: L = max(n, L0)
        cos, _ = rope_table(n, 4, 100.0, np.float64, DYN)
        assert np.allclose(cos, np.cos([by_hand(p, n) for p in range(n)]), rtol=0, atol=1e-15), n
    cos, sin = rope.angles(np.array([3, 7, 8, 19]), 32)      # decode steps: position p, L = p + 1
    assert cos.shape == (4, 1, 1, 4)
    want = np.array([by_hand(p, p + 1) for p in (3, 7, 8, 19)])
    assert np.allclose(sin[:, 0, 0], np.sin(want), rtol=0, atol=1e-15)
    cos, sin = rope.prefill_angles(np.array([12, 3]), 12)    # right-padded prompts: each row its own length
    assert cos.shape == (2, 1, 12, 4)
    for b, L in enumerate((12, 3)):
        assert np.allclose(cos[b, 0], np.cos([by_hand(p, L) for p in range(12)]), rtol=0, atol=1e-15)
    assert Rope(4, 100.0, np.float64, None).prefill_angles(np.array([3]), 3) is None
    assert np.isclose(kl.dynamic_theta(100.0, 4, DYN, np.array([20]))[0], 1600.0, rtol=1e-15)


def test_configuration_checks():
    assert check_rope_scaling({"type": "dynamic", "factor": 2}, block_size=64) == \
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    assert check_rope_scaling(DYN, block_size=64) == DYN               # L0 given: kept
    for bad, says in (({"rope_type": "dynamic"}, "factor = None"),
                      ({"rope_type": "dynamic", "factor": 0}, "factor = 0"),
                      ({"rope_type": "dynamic", "factor": 2, "original_max_position_embeddings": 8.5}, "whole number"),
                      ({"rope_type": "dynamic", "factor": 2, "attention_factor": 2}, "attention_factor")):
        with pytest.raises(RopeScalingError, match=says):
            check_rope_scaling(bad, block_size=64)
    train = TrainConfig(arch="llama", block_size=32, n_head=2, n_embd=16, n_layer=1,
                        rope_scaling=json.dumps({"rope_type": "dynamic", "factor": 2}))
    cfg = train.model_config()
    cfg.validate()
    assert cfg.rope_scaling == {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}
    with pytest.raises(ConfigError, match="factor"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8, arch="llama",
                  rope_scaling={"rope_type": "dynamic", "factor": -1}).validate()


def test_hf_config_import_and_export_keep_the_type():
    hf = hf_config(GPTConfig(vocab_size=97, block_size=32, n_layer=1, n_head=2, n_embd=8, arch="llama"), "float64")
    hf.update(max_position_embeddings=16, rope_scaling=None,
              rope_parameters={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 500.0})
    cfg = gpt_config(hf)
    assert cfg.rope_scaling == {"rope_type": "dynamic", "factor": 3.0, "original_max_position_embeddings": 16}
    assert cfg.block_size == 48 and cfg.rope_theta == 500.0          # ceil(factor L0)
    back = hf_config(cfg, "float64")
    assert back["max_position_embeddings"] == 16
    assert back["rope_parameters"] == {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 500.0}
    assert back["rope_scaling"] == {"rope_type": "dynamic", "factor": 3.0}
    assert gpt_config(back) == cfg
    legacy = {**hf, "rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}   # transformers 4
    assert gpt_config(legacy).rope_scaling["original_max_position_embeddings"] == 16


@pytest.mark.mpi(min_size=2)
def test_context_parallel_rotates_for_the_whole_sequence(world):
    """Training at cp = world with S = 9 > L0 = 4 (chunks of 2 to 5 positions, each <= L0): the serial model's
    losses and weights, so each rank's angles are the whole sequence's (L = 9), not its chunk's."""
    import steps

    from mpi_tp.model.gpt import GPT
    from mpi_tp.parallel.data_parallel import GradReducer
    from mpi_tp.training.optim import AdamW

    def run(topo, scaling):
        cfg = GPTConfig(vocab_size=37, block_size=9, n_layer=2, n_head=4, n_embd=16, arch="llama", n_kv_head=2,
                        rope_scaling=scaling)
        model = GPT(cfg, topo, dtype="float64", seed=5)
        reducer = GradReducer(model, topo.dpcp)                   # the cp ranks' gradients summed
        opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
        batch = lambda step, rows: steps.global_batch(step, rows, S=9, seed=11)     # noqa: E731
        return steps.train(model, opt, 2, 2, batch, reducer=reducer), model
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4}
    ref_losses, ref = run(Topology.serial(), scaling)
    _, plain = run(Topology.serial(), None)
    whole = {p.name: p.data for p in ref.parameters()}
    moved = max(max_rel_diff(p.data, whole[p.name]) for p in plain.parameters())
    assert moved > 1e-4                                           # L = 9 > L0: the scaling changes the training
    losses, model = run(Topology.create(world, cp=world.Get_size()), scaling)
    steps.assert_losses(losses, ref_losses, f"dynamic rope at cp={world.Get_size()}")
    for p in steps.compared(model.parameters()):
        assert_close(p.data, whole[p.name][p.index()], 1e-8, f"{p.name} at cp={world.Get_size()}", comm=world)


# ---------------------------------------------------------------- against transformers, at the pass's size

ROPE = {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 500.0}
PROMPTS = [IDS[0, :5], IDS[1, :20]]               # shorter and longer than L0 = 16; 20 + 20 = 40 positions
NEW = 20
IDS_40 = np.tile(IDS[:, :20], 2)


def fresh(model):
    """transformers' dynamic rotary state back to its start: a forward shorter than L0 resets it (its own rule)."""
    import torch
    model(torch.tensor([[0]]))
    return model


def hf_model(folder, seed=4):
    """A random-weight LlamaForCausalLM (float64, every weight moved off its start) with rope_scaling dynamic and
    max_position_embeddings 16, saved in folder."""
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**LLAMA_SIZES, "max_position_embeddings": 16, "rope_parameters": ROPE},
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def oracle(folder):
    """(logits at S = 10 and 40, and for each prompt alone its greedy tokens and every step's logits (NEW, V)):
    transformers' generate(do_sample=False), max_position_embeddings 16."""
    import torch
    model = hf_model(folder)
    with torch.no_grad():
        logits = {S: fresh(model)(torch.tensor(IDS_40[:, :S])).logits.numpy() for S in (10, 40)}
        runs = [fresh(model).generate(torch.tensor(p[None]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      max_new_tokens=NEW, do_sample=False, pad_token_id=0, output_logits=True,
                                      return_dict_in_generate=True) for p in PROMPTS]
    steps = [np.concatenate([t.numpy() for t in run.logits]) for run in runs]
    return logits, [run.sequences[0, len(p):].tolist() for run, p in zip(runs, PROMPTS)], steps


@needs_oracle
@pytest.mark.mpi(min_size=1)
def test_logits_and_greedy_tokens_equal_transformers(world, shared_dir):  # noqa: F811
    folder = os.path.join(shared_dir, "dynamic")
    logits, tokens, steps = from_rank0(lambda: oracle(folder), world)
    model = loaded(folder, Topology.create(world))
    assert model.cfg.rope_scaling["rope_type"] == "dynamic" and model.cfg.block_size == 48
    what = f"tp={world.Get_size()}"
    assert_like_oracle(model, (logits, tokens), PROMPTS, NEW, what, world, ids=IDS_40)
    # the scaling bites: the default rope's logits over 40 positions are far from transformers'
    for attn in (b.attn for b in model.h):
        attn.rope.scaling = None
    assert max_rel_diff(model.full_logits(IDS_40), logits[40]) > 1e3 * LLAMA_TOL
    # every step's logits, the two rows batched (5 and 20 long: each rotated for its own length, as alone)
    dec = Decoder(loaded(folder, Topology.create(world)), batch=2)
    got = [dec.prefill([list(p) for p in PROMPTS])]
    for i in range(NEW - 1):
        got.append(dec.step([t[i] for t in tokens]))
    for b in range(2):
        assert_close(np.stack([g[b] for g in got]), steps[b], LLAMA_TOL, f"row {b}'s step logits, {what}", comm=world)


@needs_oracle
def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    import torch
    import transformers
    from mpi4py import MPI

    from mpi_tp.checkpoint import Checkpoint
    from mpi_tp.checkpoint.hf.write import export
    from mpi_tp.commands.hf import import_folder
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    model = hf_model(src, seed=6)
    with Checkpoint(import_folder(src, str(tmp_path / "imported"), MPI.COMM_SELF)) as ck:
        export(ck, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert back.config.rope_parameters["rope_type"] == "dynamic" and back.config.max_position_embeddings == 16
    with torch.no_grad():
        want, got = (fresh(m)(torch.tensor(IDS_40)).logits.numpy() for m in (model, back))
    assert np.array_equal(want, got)
