"""Today's checkpoints in (issue 42): Llama 3's rope scaling (rope_type llama3, and linear) and Qwen2 (biases on q,
k and v; tied and untied), against transformers.

Random small folders made by transformers (float64, grouped-query attention; every weight moved off its initial
value, the q/k/v biases too), read at the pass's world size (tp = world; 3: heads and widths split unevenly):
the logits equal transformers' (which runs its norms and rotary angles in float32: LLAMA_TOL; the scaled
frequencies are the ones that differ from the default rope, so a wrong scaling is off by O(1)), greedy
generation gives transformers' own `generate(do_sample=False)` tokens over positions past the scaling's
original length, and an export loads in transformers with the same logits.

    mpiexec -n N python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_hf_models.py     (N = 1 .. 4)
"""
import os

import numpy as np
import pytest
from test_hf import (  # noqa: F401
    IDS,
    LLAMA_SIZES,
    LLAMA_TOL,
    assert_like_oracle,
    greedy_oracle,
    loaded,
    needs_oracle,
    random_transformers_folder,
    shared_dir,
)

from mpi_tp.checkpoint import open_checkpoint
from mpi_tp.core.errors import UserError
from mpi_tp.core.testing import from_rank0
from mpi_tp.parallel.topology import Topology

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}
MODELS = {   # name: (transformers class, config overrides)
    "llama3-rope": ("Llama", dict(rope_parameters={**LLAMA3, "rope_theta": 500.0})),
    "linear-rope": ("Llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0})),
    "qwen2-untied": ("Qwen2", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("Qwen2", dict(tie_word_embeddings=True)),
}
PROMPTS = [IDS[0, :5], IDS[1, :1], IDS[2, :12]]
NEW = 14                                      # 12 + 14 positions: past the llama3 scaling's original 8


def hf_folder(path, name, seed=0):
    """A random-weight *ForCausalLM of MODELS[name] in float64, saved by save_pretrained."""
    kind, overrides = MODELS[name]
    return random_transformers_folder(path, kind, {**LLAMA_SIZES, "num_key_value_heads": 3, **overrides}, seed)


def oracle(folder, name):
    return greedy_oracle(hf_folder(folder, name, seed=4), PROMPTS, NEW, (1, 5, 32))


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_greedy_tokens_equal_transformers(world, shared_dir, name):  # noqa: F811
    folder = os.path.join(shared_dir, name)
    logits, tokens = from_rank0(lambda: oracle(folder, name), world)
    model = loaded(folder, Topology.create(world))
    cfg = model.cfg
    assert cfg.qkv_bias == name.startswith("qwen2") and (cfg.rope_scaling or {}).get("rope_type") == \
        {"llama3-rope": "llama3", "linear-rope": "linear"}.get(name)
    assert_like_oracle(model, (logits, tokens), PROMPTS, NEW, f"{name} at tp={world.Get_size()}", world)


@needs_oracle
@pytest.mark.parametrize("name", ["llama3-rope", "qwen2-tied"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, name):
    import torch
    import transformers
    from mpi4py import MPI

    from mpi_tp.checkpoint import Checkpoint
    from mpi_tp.checkpoint.hf.write import export
    from mpi_tp.commands.hf import import_folder
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    model = hf_folder(src, name, seed=6)
    with Checkpoint(import_folder(src, str(tmp_path / "imported"), MPI.COMM_SELF)) as ck:
        export(ck, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert type(back) is type(model)
    with torch.no_grad():
        want, got = (m(torch.tensor(IDS[:, :20])).logits.numpy() for m in (model, back))
    assert np.array_equal(want, got)


@needs_oracle
@pytest.mark.parametrize("overrides, says", [
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                           "original_max_position_embeddings": 8}), "rope_type 'yarn' is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 2,
                           "long_factor": [2.0] * 2, "original_max_position_embeddings": 8}),
     "rope_type 'longrope' is not supported"),
])
def test_other_rope_types_are_refused_by_name(tmp_path, overrides, says):
    import transformers
    sizes = {**LLAMA_SIZES, **overrides}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).save_pretrained(str(tmp_path / "m"))
    with pytest.raises(UserError, match=says):
        open_checkpoint(str(tmp_path / "m"))
