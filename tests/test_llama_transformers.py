"""The Llama model against transformers' LlamaForCausalLM, through the name table of mpi_tp.model.llama.

    .venv/bin/python -m pytest -q tests/test_llama_transformers.py     (skipped without torch, transformers)

A tiny LlamaForCausalLM with random weights (float64, grouped-query attention, tied and untied), its
weights copied into the serial model by the table (transposing the linear layers): the same logits
and loss, to float32's rounding (transformers computes its norms and angles in float32). So the
rotary layout, the head order and grouping, the norms and the MLP are transformers'. No MPI.
"""
import numpy as np
import pytest

from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.model.llama import parameter_shapes
from mpi_tp.parallel.topology import Topology

HF = {"wte": "model.embed_tokens.weight", "ln_f/weight": "model.norm.weight", "lm_head": "lm_head.weight"}
LAYER = {"ln_1/weight": "input_layernorm.weight", "attn/q/weight": "self_attn.q_proj.weight",
         "attn/k/weight": "self_attn.k_proj.weight", "attn/v/weight": "self_attn.v_proj.weight",
         "attn/proj/weight": "self_attn.o_proj.weight", "ln_2/weight": "post_attention_layernorm.weight",
         "mlp/gate/weight": "mlp.gate_proj.weight", "mlp/up/weight": "mlp.up_proj.weight",
         "mlp/down/weight": "mlp.down_proj.weight"}


def hf_name(name: str) -> tuple[str, bool]:
    """(transformers' name, whether the array is transposed) for an mpi_tp parameter name."""
    if name in HF:
        return HF[name], False
    _, i, rest = name.split("/", 2)
    return f"model.layers.{i}.{LAYER[rest]}", True


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_equal_transformers(tied):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    V, C, H, H_kv, F, L, S = 41, 32, 4, 2, 40, 2, 9
    hf_cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=C, num_attention_heads=H, num_key_value_heads=H_kv,
                                      intermediate_size=F, num_hidden_layers=L, rope_theta=1000.0,
                                      rms_norm_eps=1e-6, max_position_embeddings=S, tie_word_embeddings=tied,
                                      attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).double().eval()
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    rng = np.random.default_rng(0)
    for k in state:                              # the norms' weights too (they start at ones)
        if "norm" in k:
            state[k] = 1.0 + 0.1 * rng.standard_normal(state[k].shape)
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    cfg = GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=H, n_embd=C, arch="llama", n_kv_head=H_kv,
                    intermediate_size=F, rope_theta=1000.0, norm_eps=1e-6, tie_word_embeddings=tied)
    model = GPT(cfg, Topology.serial(), dtype="float64").eval()
    assert {p.name: p.global_shape for p in model.parameters()} == parameter_shapes(cfg)
    for p in model.parameters():
        name, transposed = hf_name(p.name)
        p.data[...] = state[name].T if transposed else state[name]
    ids = rng.integers(0, V, (2, S))
    with torch.no_grad():
        out = hf(torch.tensor(ids), labels=torch.tensor(ids))
    want = out.logits.numpy()
    got = model.full_logits(ids)
    # transformers normalises in float32 and computes the rotary angles in float32, whatever the model's
    # dtype: agreement to float32's rounding (a wrong pairing, head order or grouping differs by O(1))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-6, err
    # transformers' loss predicts position t + 1 from t; ours takes the targets as given
    loss = model.forward(ids[:, :-1], ids[:, 1:])
    assert abs(loss - float(out.loss)) < 1e-6 * abs(float(out.loss))
