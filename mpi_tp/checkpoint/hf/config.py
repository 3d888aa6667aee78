"""A Hugging Face config.json as an mpi_tp GPTConfig and back, and a refusal for whatever mpi_tp does not compute.

GPT-2 (GPT2Config, model_type "gpt2"), arch "gpt2":

    config.json                      GPTConfig / what mpi_tp computes
    n_embd, n_head, n_layer          n_embd, n_head, n_layer
    n_positions                      block_size (the rows of wpe)
    vocab_size                       vocab_size (kept: 50257 for a real GPT-2; ids in, logits out)
    n_inner (null: 4 n_embd)         intermediate_size (the MLP's width)
    layer_norm_epsilon               norm_eps
    activation_function              gelu_new or gelu_pytorch_tanh: the tanh GELU (kernels.gelu_forward)
    scale_attn_weights: true         softmax(q k^T / sqrt(hs))
    tie_word_embeddings: true        the output layer is wte (no lm_head of its own)
    resid/embd/attn_pdrop            dropout (training only; one rate for the three sites, mpi_tp's too)

Llama (LlamaConfig, model_type "llama"), arch "llama":

    hidden_size, num_attention_heads, num_hidden_layers     n_embd, n_head, n_layer
    num_key_value_heads (null: the heads)                   n_kv_head (grouped-query attention)
    intermediate_size                                       intermediate_size (SwiGLU's width)
    max_position_embeddings                                 block_size (the longest sequence)
    rope_theta (transformers 5: rope_parameters.rope_theta) rope_theta
    rope_scaling (5: rope_parameters' rope_type ...)        rope_scaling: default, linear, llama3 (Llama 3.1-3.3),
                                                            dynamic; any other refused by name
                                                            (mpi_tp.model.rope_scaling)
    dynamic: max_position_embeddings                        its original_max_position_embeddings L0 (transformers'
                                                            dynamic reads it there), block_size = ceil(factor L0)
                                                            (transformers sets no limit; mpi_tp's cache needs one);
                                                            an export writes L0 back as max_position_embeddings
    rms_norm_eps                                            norm_eps
    tie_word_embeddings                                     tie_word_embeddings (false: lm_head)
    hidden_act: silu; attention_bias, mlp_bias: false; head_dim: hidden_size / num_attention_heads

Qwen2 (Qwen2Config, model_type "qwen2"), arch "llama" with qkv_bias: Llama's fields, biases on q, k and v
(tied or not); use_sliding_window (or a sliding_attention layer) refused.

Mixtral (MixtralConfig, model_type "mixtral"), arch "llama" with a mixture of experts in every block:
Llama's fields above, and

    num_local_experts, num_experts_per_tok      moe_experts E, moe_top_k k
    (Mixtral's router)                          moe_router softmax, moe_topk_norm sum: softmax over the E
                                                logits in fp32, the k best, divided by their sum (k = 1: 1)
    intermediate_size                           each expert's width (SwiGLU: w1 gate, w3 up, w2 down)
    (dropless)                                  moe_capacity 0: every assignment computed
    router_aux_loss_coef (if output_router_logits)   moe_aux_weight (training only; 0 otherwise)
    router_jitter_noise: 0; sliding_window: null or at least max_position_embeddings

Anything else that changes the numbers (another model type, activation, attention scaling, biases,
rope scaling, cross-attention, ...) is refused with one line naming it: a model that loads must
compute what transformers computes.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace

from mpi_tp.checkpoint.format import CheckpointError
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.rope_scaling import RopeScalingError, check_rope_scaling
from mpi_tp.model.routing import normalises

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"), "llama": ("LlamaForCausalLM", "LlamaModel"),
                 "mixtral": ("MixtralForCausalLM", "MixtralModel"), "qwen2": ("Qwen2ForCausalLM", "Qwen2Model")}


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


def _require(hf: dict, folder: str, settings) -> None:
    """settings: (key, the value mpi_tp computes, what that means); a key absent counts as that value."""
    for key, want, meaning in settings:
        if key in hf and hf[key] != want:
            raise _refuse(folder, f"{key} = {json.dumps(hf[key])} is not supported (mpi_tp computes {key} = "
                                  f"{json.dumps(want)}: {meaning})")


def _sizes(hf: dict, folder: str, names) -> dict:
    """{our field: config.json's positive integer} for names = ((ours, theirs), ...)."""
    sizes = {}
    for ours, theirs in names:
        value = hf.get(theirs)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(folder, f"{theirs} = {value!r}: config.json needs a positive integer")
        sizes[ours] = value
    return sizes


def _eps(hf: dict, folder: str, key: str) -> float:
    value = hf.get(key, 1e-5)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _refuse(folder, f"{key} = {value!r}: config.json needs a positive number")
    return float(value)


def gpt_config(hf: dict, folder: str = "") -> GPTConfig:
    """GPTConfig of a GPT-2 or Llama config.json, or one HFConfigError naming the first setting mpi_tp lacks."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise _refuse(folder, f"model_type {kind!r} is not supported (mpi_tp imports {' and '.join(ARCHITECTURES)})")
    arch = hf.get("architectures") or [ARCHITECTURES[kind][0]]
    if not set(arch) <= set(ARCHITECTURES[kind]):
        raise _refuse(folder, f"architectures {arch} are not supported (mpi_tp imports {ARCHITECTURES[kind][0]})")
    if kind == "gpt2" and hf.get("rope_scaling") is not None:
        raise _refuse(folder, f"rope_scaling {json.dumps(hf['rope_scaling'])} is not supported")
    cfg = {"llama": _llama, "mixtral": _mixtral, "qwen2": _qwen2, "gpt2": _gpt2}[kind](hf, folder)
    cfg.validate()
    return cfg


def _gpt2(hf: dict, folder: str) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_TANH:
        raise _refuse(folder, f"activation_function {act!r} is not supported (mpi_tp's GELU is the tanh "
                              f"approximation: {' or '.join(GELU_TANH)})")
    _require(hf, folder, (("scale_attn_weights", True, "attention scaled by 1/sqrt(head size)"),
                          ("scale_attn_by_inverse_layer_idx", False, "no extra 1/(layer+1) scaling"),
                          ("reorder_and_upcast_attn", False, "attention in the model's dtype"),
                          ("add_cross_attention", False, "no cross-attention"),
                          ("tie_word_embeddings", True, "GPT-2's output layer is the tied wte")))
    sizes = _sizes(hf, folder, (("vocab_size", "vocab_size"), ("block_size", "n_positions"),
                                ("n_layer", "n_layer"), ("n_head", "n_head"), ("n_embd", "n_embd")))
    inner = hf.get("n_inner")
    if inner is not None:
        inner = _sizes(hf, folder, (("n_inner", "n_inner"),))["n_inner"]
    drops = {hf.get(k, 0.0) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    dropout = drops.pop() if len(drops) == 1 else 0.0     # training only (not compared on load)
    return GPTConfig(**sizes, arch="gpt2", intermediate_size=None if inner == 4 * sizes["n_embd"] else inner,
                     norm_eps=_eps(hf, folder, "layer_norm_epsilon"),
                     dropout=float(dropout) if isinstance(dropout, (int, float)) and 0 <= dropout < 1 else 0.0)


def _llama(hf: dict, folder: str) -> GPTConfig:
    _require(hf, folder, (("hidden_act", "silu", "SwiGLU's gate is silu"),
                          ("attention_bias", False, "q, k, v and o without biases"),
                          ("mlp_bias", False, "gate, up and down without biases"),
                          ("pretraining_tp", 1, "each linear layer in one product"),
                          ("partial_rotary_factor", 1.0, "every dimension of a head rotated")))
    rope = hf.get("rope_parameters") or {}          # transformers 5 keeps rope_theta and rope_type here
    if not isinstance(rope, dict) or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(folder, f"rope_parameters {json.dumps(rope)} are not supported (mpi_tp rotates every "
                              "dimension of a head)")
    key = "rope_parameters" if rope.get("rope_type", "default") != "default" else "rope_scaling"   # (4: rope_scaling)
    scaling = rope if key == "rope_parameters" else hf.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "dynamic":
        L0 = hf.get("max_position_embeddings")                # what transformers' dynamic reads as L0
        scaling = {**scaling, "original_max_position_embeddings": L0}
    try:
        scaling = check_rope_scaling(scaling)
    except RopeScalingError as e:
        raise _refuse(folder, f"{key} {json.dumps(hf.get(key))}: {e}") from None
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    sizes = _sizes(hf, folder, (("vocab_size", "vocab_size"), ("block_size", "max_position_embeddings"),
                                ("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
                                ("n_embd", "hidden_size"), ("intermediate_size", "intermediate_size")))
    if scaling is not None and scaling["rope_type"] == "dynamic":
        sizes["block_size"] = math.ceil(scaling["factor"] * sizes["block_size"])
    C, H = sizes["n_embd"], sizes["n_head"]
    if hf.get("head_dim") not in (None, C // H) or C % H:
        raise _refuse(folder, f"head_dim = {hf.get('head_dim')} is not supported (mpi_tp's head size is "
                              f"hidden_size / num_attention_heads = {C} / {H})")
    kv = hf.get("num_key_value_heads")
    kv = sizes["n_head"] if kv is None else _sizes(hf, folder, (("kv", "num_key_value_heads"),))["kv"]
    tied = hf.get("tie_word_embeddings", False)     # LlamaConfig's default
    if not isinstance(tied, bool):
        raise _refuse(folder, f"tie_word_embeddings = {tied!r}: config.json needs true or false")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise _refuse(folder, f"rope_theta = {theta!r}: config.json needs a positive number")
    dropout = hf.get("attention_dropout", 0.0)
    return GPTConfig(**sizes, arch="llama", n_kv_head=kv, rope_theta=float(theta), rope_scaling=scaling,
                     norm_eps=_eps(hf, folder, "rms_norm_eps"), tie_word_embeddings=tied,
                     dropout=float(dropout) if isinstance(dropout, (int, float)) and 0 <= dropout < 1 else 0.0)


def _qwen2(hf: dict, folder: str) -> GPTConfig:
    """Qwen2: Llama with biases on q, k and v; a sliding window (use_sliding_window, layer_types) refused."""
    layers = hf.get("layer_types") or []
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in layers):
        raise _refuse(folder, "use_sliding_window / sliding_attention layers are not supported (mpi_tp attends to "
                              "every earlier position)")
    return replace(_llama(hf, folder), qkv_bias=True)


def _mixtral(hf: dict, folder: str) -> GPTConfig:
    _require(hf, folder, (("router_jitter_noise", 0.0, "the router reads the input as it is"),))
    window, S = hf.get("sliding_window"), hf.get("max_position_embeddings")
    if window is not None and not (isinstance(S, int) and isinstance(window, int) and window >= S):
        raise _refuse(folder, f"sliding_window = {window!r} is not supported (mpi_tp attends to every earlier "
                              f"position: a window of null, or at least max_position_embeddings = {S})")
    moe = _sizes(hf, folder, (("moe_experts", "num_local_experts"), ("moe_top_k", "num_experts_per_tok")))
    coef = hf.get("router_aux_loss_coef", 0.001) if hf.get("output_router_logits") else 0.0
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise _refuse(folder, f"router_aux_loss_coef = {coef!r}: config.json needs a number >= 0")
    return replace(_llama(hf, folder), **moe, moe_router="softmax", moe_topk_norm="sum", moe_capacity=0.0,
                   moe_aux_weight=float(coef), moe_z_weight=0.0, moe_every=1)


def mixtral_refusal(cfg: GPTConfig) -> str | None:
    """Why MixtralForCausalLM cannot compute this mixture of experts (None: it can)."""
    if not cfg.llama:
        return "its experts are GPT-2 MLPs (GELU, biases); Mixtral's are SwiGLU: a llama model exports"
    why = {"moe_every": (cfg.moe_every == 1, f"moe_every = {cfg.moe_every}: Mixtral's blocks are all MoE blocks"),
           "moe_shared_experts": (not cfg.moe_shared_experts, "shared experts, which Mixtral has not"),
           "moe_router": (cfg.moe_router != "sigmoid", "the sigmoid router (DeepSeek-V3's); Mixtral's is a softmax"),
           "moe_topk_norm": (normalises(cfg.moe_router, cfg.moe_topk_norm, cfg.moe_top_k),
                             "gates not divided by their sum; Mixtral normalises its k gates (top-1: a gate of 1)"),
           "moe_gate_scale": (cfg.moe_gate_scale == 1.0, f"gates scaled by {cfg.moe_gate_scale:g}; Mixtral's are not"),
           "moe_capacity": (cfg.moe_capacity == 0, f"a capacity ({cfg.moe_capacity:g}) that drops assignments; "
                                                   "Mixtral computes every one (export a model trained dropless)")}
    bad = [text for ok, text in why.values() if not ok]
    return "; ".join(bad) if bad else None


def hf_config(cfg: GPTConfig, dtype: str) -> dict:
    """The config.json of GPT2LMHeadModel, LlamaForCausalLM or (a llama model with experts in every block)
    MixtralForCausalLM for an mpi_tp GPTConfig (export checks mixtral_refusal first)."""
    common = {"vocab_size": cfg.vocab_size, "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None,
              "use_cache": True, "dtype": dtype, "torch_dtype": dtype}    # transformers 5 reads dtype, 4 torch_dtype
    if cfg.llama and cfg.qkv_bias and not cfg.moe_experts:
        llama = hf_config(replace(cfg, qkv_bias=False), dtype)
        for key in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim"):      # Qwen2Config has none
            llama.pop(key)
        return {**llama, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": cfg.n_layer}
    if cfg.llama and cfg.moe_experts:
        llama = hf_config(replace(cfg, moe_experts=0), dtype)
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):      # MixtralConfig has none of them
            llama.pop(key)
        return {**llama, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
                "output_router_logits": cfg.moe_aux_weight > 0, "router_aux_loss_coef": cfg.moe_aux_weight,
                "router_jitter_noise": 0.0, "sliding_window": None}
    if cfg.llama:
        scaling, positions = dict(cfg.rope_scaling or {}), cfg.block_size
        if scaling.get("rope_type") == "dynamic":      # transformers' dynamic reads L0 as max_position_embeddings
            positions = scaling.pop("original_max_position_embeddings")
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
                "hidden_size": cfg.n_embd, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.n_layer,
                "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads,
                "head_dim": cfg.n_embd // cfg.n_head, "max_position_embeddings": positions,
                "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "rope_scaling": scaling or None,
                "rope_parameters": {"rope_type": "default", **scaling, "rope_theta": cfg.rope_theta},
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
                "attention_dropout": cfg.dropout, "tie_word_embeddings": cfg.tied}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **common,
            "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": cfg.intermediate_size, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "tie_word_embeddings": True}
