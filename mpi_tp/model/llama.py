"""The Llama architecture's parameters: their names, shapes and Hugging Face counterparts, in one place.

`GPTConfig(arch="llama", ...)` builds the same GPT class as GPT-2 (mpi_tp.model.gpt) from Llama's
pieces: RMSNorm (mpi_tp.model.rmsnorm), rotary q and k (mpi_tp.model.rope), grouped-query attention
(mpi_tp.model.heads, mpi_tp.model.qkv), the SwiGLU MLP (mpi_tp.model.swiglu), no biases, no position
table, and the output layer tied to wte or its own table lm_head (the default).

Legend: V = vocab_size, C = n_embd, H = n_head, H_kv = n_kv_head, hs = C / H, F = intermediate_size, i the
block. Every matrix is stored (in, out), y = x @ W, so a Hugging Face nn.Linear weight (out, in) is
its transpose; the embedding tables are (V, C) in both. Names are those of Param.name, checkpoints
(`model/<name>`), and `mpi-tp inspect`. "split" is the tensor-parallel axis (mpi_tp.model.heads for
the head split: q by query heads, k and v by key/value heads, replicated when H_kv < T).

    mpi_tp name             shape         split    LlamaForCausalLM name                             as stored
    wte                     (V, C)        rows     model.embed_tokens.weight                         same
    h/{i}/ln_1/weight       (C,)          -        model.layers.{i}.input_layernorm.weight           same
    h/{i}/attn/q/weight     (C, H hs)     columns  model.layers.{i}.self_attn.q_proj.weight          transposed
    h/{i}/attn/k/weight     (C, H_kv hs)  columns  model.layers.{i}.self_attn.k_proj.weight          transposed
    h/{i}/attn/v/weight     (C, H_kv hs)  columns  model.layers.{i}.self_attn.v_proj.weight          transposed
    h/{i}/attn/proj/weight  (H hs, C)     rows     model.layers.{i}.self_attn.o_proj.weight          transposed
    h/{i}/ln_2/weight       (C,)          -        model.layers.{i}.post_attention_layernorm.weight  same
    h/{i}/mlp/gate/weight   (C, F)        columns  model.layers.{i}.mlp.gate_proj.weight             transposed
    h/{i}/mlp/up/weight     (C, F)        columns  model.layers.{i}.mlp.up_proj.weight               transposed
    h/{i}/mlp/down/weight   (F, C)        rows     model.layers.{i}.mlp.down_proj.weight             transposed
    ln_f/weight             (C,)          -        model.norm.weight                                 same
    lm_head                 (V, C)        rows     lm_head.weight (absent when tied: wte serves)     same

The columns of q (and k, v) are head-major, head h's hs dimensions at [h hs, (h + 1) hs), and within a
head the rotation pairs dimension j with j + hs/2 (rotate_half), as in transformers' LlamaAttention:
no permutation of q_proj or k_proj is needed (Meta's original checkpoints interleave the pairs and
need transformers' conversion permutation first). Query head h reads key/value head h // (H / H_kv), as
transformers' repeat_kv. Configuration: hidden_size = C, num_attention_heads = H,
num_key_value_heads = H_kv, intermediate_size = F, num_hidden_layers = n_layer, rope_theta, rms_norm_eps =
norm_eps, tie_word_embeddings, vocab_size, max_position_embeddings >= block_size, attention_bias and
mlp_bias false, hidden_act "silu", no rope_scaling. tests/test_llama_transformers.py checks the table
against transformers' LlamaForCausalLM, logit for logit.

Mixture of experts (moe_experts > 0; block i an MoE block when i % moe_every == moe_every - 1): the
block's MLP parameters become h/{i}/moe/router/weight (C, E), replicated, and per expert e
h/{i}/moe/experts/{e}/gate/weight, .../up/weight (C, F) and .../down/weight (F, C), split as the dense
MLP's (mpi_tp.model.experts); Mixtral's names for them are block_sparse_moe.gate.weight (E, C) and
block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down), transposed the same way.
"""
from __future__ import annotations

from mpi_tp.model.config import GPTConfig


def parameter_shapes(cfg: GPTConfig) -> dict[str, tuple]:
    """{name: full shape} of every parameter of a Llama model with this configuration, in the model's order."""
    if not cfg.llama:
        raise ValueError(f"parameter_shapes lists a llama model's parameters; this configuration is {cfg.arch}")
    C, H, H_kv, F, V = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.ffn, cfg.vocab_size
    hs = C // H
    out = {"wte": (V, C)}
    for i in range(cfg.n_layer):
        out.update({f"h/{i}/ln_1/weight": (C,), f"h/{i}/attn/q/weight": (C, H * hs),
                    f"h/{i}/attn/k/weight": (C, H_kv * hs), f"h/{i}/attn/v/weight": (C, H_kv * hs),
                    f"h/{i}/attn/proj/weight": (H * hs, C), f"h/{i}/ln_2/weight": (C,)})
        if cfg.qkv_bias:                                     # Qwen2
            out.update({f"h/{i}/attn/q/bias": (H * hs,), f"h/{i}/attn/k/bias": (H_kv * hs,),
                        f"h/{i}/attn/v/bias": (H_kv * hs,)})
        mlps = [f"h/{i}/mlp"]
        if cfg.is_moe_block(i):
            out[f"h/{i}/moe/router/weight"] = (C, cfg.moe_experts)
            mlps = [f"h/{i}/moe/experts/{e}" for e in range(cfg.moe_experts)]
        for mlp in mlps:
            out.update({f"{mlp}/gate/weight": (C, F), f"{mlp}/up/weight": (C, F), f"{mlp}/down/weight": (F, C)})
    out["ln_f/weight"] = (C,)
    if not cfg.tied:
        out["lm_head"] = (V, C)
    return out
