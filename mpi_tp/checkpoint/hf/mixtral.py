"""Which mixtures of experts MixtralForCausalLM computes: export writes a llama MoE as a Mixtral folder only then.

Mixtral's block (transformers' MixtralSparseMoeBlock): every block a mixture of SwiGLU experts, a router
without bias whose softmax over the E logits picks the k best, their gates divided by their sum (k = 1: a
gate of 1), every assignment computed (dropless). config.py reads such a folder; names.py has its tensors.
"""
from __future__ import annotations

from mpi_tp.model.config import GPTConfig
from mpi_tp.model.routing import normalises


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
