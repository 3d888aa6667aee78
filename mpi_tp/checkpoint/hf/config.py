"""A Hugging Face config.json as an mpi_tp GPTConfig and back, and a refusal for whatever mpi_tp does not compute.

GPT-2 (transformers' GPT2Config, model_type "gpt2") maps field by field:

    config.json                      GPTConfig / what mpi_tp computes
    n_embd, n_head, n_layer          n_embd, n_head, n_layer
    n_positions                      block_size (the rows of wpe)
    vocab_size                       vocab_size (kept: 50257 for a real GPT-2; ids in, logits out)
    n_inner: null                    the MLP is 4 n_embd wide
    activation_function              gelu_new or gelu_pytorch_tanh: the tanh GELU (kernels.gelu_forward)
    layer_norm_epsilon: 1e-5         LayerNorm's eps
    scale_attn_weights: true         softmax(q k^T / sqrt(hs))
    tie_word_embeddings: true        the output layer is wte (no lm_head of its own)
    resid/embd/attn_pdrop           dropout (training only; one rate for the three sites, mpi_tp's too)

Anything else that changes the numbers (another model type, activation, epsilon, attention scaling,
biases, rope scaling, cross-attention, an untied head) is refused with one line naming it: a model
that loads must compute what transformers computes.
"""
from __future__ import annotations

import json
import os

from mpi_tp.checkpoint.format import CheckpointError
from mpi_tp.model.config import GPTConfig

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
LAYER_NORM_EPS = 1e-5                            # mpi_tp.model.layernorm.LayerNorm's


class HFConfigError(CheckpointError):
    """A Hugging Face folder whose model mpi_tp does not compute; the message names the setting."""


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise HFConfigError(f"cannot read {path} ({e}): a Hugging Face model folder needs its config.json") from None
    if not isinstance(hf, dict):
        raise HFConfigError(f"{path} holds no JSON object")
    return hf


def _refuse(folder: str, what: str) -> HFConfigError:
    return HFConfigError(f"Hugging Face model {folder}: {what}")


def gpt_config(hf: dict, folder: str = "") -> GPTConfig:
    """GPTConfig of a GPT-2 config.json, or one HFConfigError naming the first setting mpi_tp lacks."""
    kind = hf.get("model_type")
    if kind != "gpt2":
        raise _refuse(folder, f"model_type {kind!r} is not supported (mpi_tp imports 'gpt2')")
    arch = hf.get("architectures") or ["GPT2LMHeadModel"]
    if not set(arch) <= {"GPT2LMHeadModel", "GPT2Model"}:
        raise _refuse(folder, f"architectures {arch} are not supported (mpi_tp imports GPT2LMHeadModel)")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        raise _refuse(folder, f"activation_function {act!r} is not supported (mpi_tp's GELU is the tanh "
                              f"approximation: {' or '.join(GELU_TANH)})")
    eps = hf.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise _refuse(folder, f"layer_norm_epsilon {eps} is not supported (mpi_tp's LayerNorm uses {LAYER_NORM_EPS})")
    # (key, the value mpi_tp computes, what it means)
    for key, want, meaning in (("scale_attn_weights", True, "attention scaled by 1/sqrt(head size)"),
                               ("scale_attn_by_inverse_layer_idx", False, "no extra 1/(layer+1) scaling"),
                               ("reorder_and_upcast_attn", False, "attention in the model's dtype"),
                               ("add_cross_attention", False, "no cross-attention"),
                               ("tie_word_embeddings", True, "the output layer is the tied wte")):
        if hf.get(key, want) != want:
            raise _refuse(folder, f"{key} = {json.dumps(hf[key])} is not supported (mpi_tp computes {key} = "
                                  f"{json.dumps(want)}: {meaning})")
    n_embd = hf.get("n_embd")
    inner = hf.get("n_inner")
    if inner is not None and inner != 4 * (n_embd or 0):
        raise _refuse(folder, f"n_inner = {inner} is not supported (mpi_tp's MLP is 4 n_embd = "
                              f"{4 * (n_embd or 0)} wide)")
    if hf.get("rope_scaling") is not None:
        raise _refuse(folder, f"rope_scaling {hf['rope_scaling']} is not supported")
    sizes = {}
    for ours, theirs in (("vocab_size", "vocab_size"), ("block_size", "n_positions"), ("n_layer", "n_layer"),
                         ("n_head", "n_head"), ("n_embd", "n_embd")):
        value = hf.get(theirs)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(folder, f"{theirs} = {value!r}: config.json needs a positive integer")
        sizes[ours] = value
    drops = {hf.get(k, 0.0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    dropout = drops.pop() if len(drops) == 1 else 0.0     # training only (not compared on load)
    cfg = GPTConfig(**sizes, dropout=float(dropout) if 0 <= dropout < 1 else 0.0)
    cfg.validate()
    return cfg


def hf_config(cfg: GPTConfig, dtype: str) -> dict:
    """The config.json of GPT2LMHeadModel for an mpi_tp GPTConfig (a dense one: export refuses MoE)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": True, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "use_cache": True,
        "dtype": dtype, "torch_dtype": dtype,        # transformers 5 reads dtype, 4 torch_dtype
    }
