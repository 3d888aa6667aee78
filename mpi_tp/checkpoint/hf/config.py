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

Mistral (MistralConfig, model_type "mistral"), arch "llama": Llama's fields (the same tensor names), and

    sliding_window (absent: 4096, MistralConfig's default; null: none)   sliding_window W: a query at position t
                                                            sees keys t - W < s <= t; None (full causal attention)
                                                            when null or at least max_position_embeddings

Qwen2 (Qwen2Config, model_type "qwen2"), arch "llama" with qkv_bias: Llama's fields, biases on q, k and v
(tied or not); a window as transformers sets it: sliding_window when use_sliding_window, in the layers
layer_types names sliding_attention (absent: layers max_window_layers and up). mpi_tp's window is the same in
every layer: all layers sliding (max_window_layers 0) or none; a mix is refused by name.

Mixtral (MixtralConfig, model_type "mixtral"), arch "llama" with a mixture of experts in every block:
Llama's fields above, and

    num_local_experts, num_experts_per_tok      moe_experts E, moe_top_k k (k <= E)
    rope_theta (absent: 1e6, MixtralConfig's)   rope_theta
    (Mixtral's router)                          moe_router softmax, moe_topk_norm sum: softmax over the E
                                                logits in fp32, the k best, divided by their sum (k = 1: 1)
    intermediate_size                           each expert's width (SwiGLU: w1 gate, w3 up, w2 down)
    (dropless)                                  moe_capacity 0: every assignment computed
    router_aux_loss_coef (if output_router_logits)   moe_aux_weight (training only; 0 otherwise)
    router_jitter_noise: 0; sliding_window                    sliding_window (as Mistral's; absent: null)

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

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
ARCHITECTURES = {"gpt2": ("GPT2LMHeadModel", "GPT2Model"), "llama": ("LlamaForCausalLM", "LlamaModel"),
                 "mistral": ("MistralForCausalLM", "MistralModel"), "mixtral": ("MixtralForCausalLM", "MixtralModel"),
                 "qwen2": ("Qwen2ForCausalLM", "Qwen2Model")}


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
    cfg = {"llama": _llama, "mistral": _mistral, "mixtral": _mixtral, "qwen2": _qwen2, "gpt2": _gpt2}[kind](hf, folder)
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


def _window(cfg: GPTConfig, hf: dict, folder: str, W) -> GPTConfig:
    """cfg with config.json's sliding_window W (an int, or None: full causal); a window at least block_size
    long never binds: None."""
    if W is not None and (isinstance(W, bool) or not isinstance(W, int) or W < 1):
        raise _refuse(folder, f"sliding_window = {W!r}: config.json needs a positive integer or null")
    return replace(cfg, sliding_window=W if W is not None and W < cfg.block_size else None)


def _mistral(hf: dict, folder: str) -> GPTConfig:
    """Mistral: Llama with a sliding window (MistralConfig's default 4096 when config.json has none)."""
    return _window(_llama(hf, folder), hf, folder, hf.get("sliding_window", 4096))


def _qwen2(hf: dict, folder: str) -> GPTConfig:
    """Qwen2: Llama with biases on q, k and v, and a window in all layers or none (see the module's docstring)."""
    cfg = replace(_llama(hf, folder), qkv_bias=True)
    W = hf.get("sliding_window", 4096) if hf.get("use_sliding_window") else None
    L, first = cfg.n_layer, hf.get("max_window_layers", 28)
    kinds = hf.get("layer_types") or ["sliding_attention" if W is not None and i >= first else "full_attention"
                                      for i in range(L)]
    if not isinstance(kinds, list) or len(kinds) != L or not set(kinds) <= {"full_attention", "sliding_attention"}:
        raise _refuse(folder, f"layer_types = {json.dumps(kinds)} is not supported (one of full_attention or "
                              f"sliding_attention for each of the {L} layers)")
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"] if W is not None else []
    if 0 < len(sliding) < L:
        raise _refuse(folder, f"layer_types: layers {sliding} are sliding_attention and the others full_attention "
                              f"(max_window_layers = {first}); mpi_tp's window is the same in every layer: all "
                              "sliding (max_window_layers 0) or none")
    return _window(cfg, hf, folder, W if sliding else None)


def _mixtral(hf: dict, folder: str) -> GPTConfig:
    _require(hf, folder, (("router_jitter_noise", 0.0, "the router reads the input as it is"),))
    moe = _sizes(hf, folder, (("moe_experts", "num_local_experts"), ("moe_top_k", "num_experts_per_tok")))
    if moe["moe_top_k"] > moe["moe_experts"]:
        raise _refuse(folder, f"num_experts_per_tok = {moe['moe_top_k']} exceeds num_local_experts = "
                              f"{moe['moe_experts']}: a token's k experts are k of the E")
    rope = hf.get("rope_parameters")
    if "rope_theta" not in hf and not (isinstance(rope, dict) and "rope_theta" in rope):
        hf = {**hf, "rope_theta": 1e6}                  # MixtralConfig's default, not Llama's 10000
    coef = hf.get("router_aux_loss_coef", 0.001) if hf.get("output_router_logits") else 0.0
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise _refuse(folder, f"router_aux_loss_coef = {coef!r}: config.json needs a number >= 0")
    return replace(_window(_llama(hf, folder), hf, folder, hf.get("sliding_window")), **moe, moe_router="softmax",
                   moe_topk_norm="sum", moe_capacity=0.0, moe_aux_weight=float(coef), moe_z_weight=0.0, moe_every=1)


def hf_config(cfg: GPTConfig, dtype: str) -> dict:
    """The config.json of GPT2LMHeadModel or, for a llama model, the first that computes it of Qwen2ForCausalLM
    (q, k, v biases), MixtralForCausalLM (experts in every block; export asks mixtral.mixtral_refusal first),
    MistralForCausalLM (a sliding window) and LlamaForCausalLM. A window goes into Qwen2's and Mixtral's too."""
    common = {"vocab_size": cfg.vocab_size, "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None,
              "use_cache": True, "dtype": dtype, "torch_dtype": dtype}    # transformers 5 reads dtype, 4 torch_dtype
    W = cfg.sliding_window
    if cfg.llama and cfg.qkv_bias and not cfg.moe_experts:
        llama = hf_config(replace(cfg, qkv_bias=False, sliding_window=None), dtype)
        for key in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim"):      # Qwen2Config has none
            llama.pop(key)
        return {**llama, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": W
                is not None, "sliding_window": W, "max_window_layers": cfg.n_layer if W is None else 0}
    if cfg.llama and (cfg.moe_experts or W is not None):
        llama = hf_config(replace(cfg, moe_experts=0, sliding_window=None), dtype)
        for key in ("attention_bias", "mlp_bias", "pretraining_tp"):      # Mixtral- and MistralConfig have none
            llama.pop(key)
        if not cfg.moe_experts:
            return {**llama, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": W}
        return {**llama, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
                "output_router_logits": cfg.moe_aux_weight > 0, "router_aux_loss_coef": cfg.moe_aux_weight,
                "router_jitter_noise": 0.0, "sliding_window": W}
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
