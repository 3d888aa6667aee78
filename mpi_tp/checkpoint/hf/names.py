"""Which Hugging Face tensor holds each mpi_tp parameter, and where in it.

GPT2LMHeadModel (pre = "transformer.", or "" in a folder saved from GPT2Model, such as the
original gpt2 release), C = n_embd, H = n_head, H_kv = n_kv_head, hs = C / H, for each block i:

    mpi_tp name (shape)            Hugging Face tensor (shape)               part
    wte (V, C)                   pre wte.weight (V, C)                       whole
    wpe (block_size, C)          pre wpe.weight (n_positions, C)             whole
    h/i/ln_1/{weight,bias} (C,)  pre h.i.ln_1.{weight,bias} (C,)             whole
    h/i/attn/q/weight (C, C)     pre h.i.attn.c_attn.weight (C, 3C)          columns [0, C)
    h/i/attn/k/weight (C, C)         "                                       columns [C, 2C)
    h/i/attn/v/weight (C, C)         "                                       columns [2C, 3C)
    h/i/attn/{q,k,v}/bias (C,)   pre h.i.attn.c_attn.bias (3C,)              [0, C), [C, 2C), [2C, 3C)
    h/i/attn/proj/weight (C, C)  pre h.i.attn.c_proj.weight (C, C)           whole
    h/i/attn/proj/bias (C,)      pre h.i.attn.c_proj.bias (C,)               whole
    h/i/ln_2/{weight,bias} (C,)  pre h.i.ln_2.{weight,bias} (C,)             whole
    h/i/mlp/fc/weight (C, F)     pre h.i.mlp.c_fc.weight (C, F)              whole (F = n_inner, or 4C)
    h/i/mlp/fc/bias (F,)         pre h.i.mlp.c_fc.bias (F,)                  whole
    h/i/mlp/proj/weight (F, C)   pre h.i.mlp.c_proj.weight (F, C)            whole
    h/i/mlp/proj/bias (C,)       pre h.i.mlp.c_proj.bias (C,)                whole
    ln_f/{weight,bias} (C,)      pre ln_f.{weight,bias} (C,)                 whole
    (the tied output layer)        lm_head.weight (V, C): wte; not read, not written

No transposition: GPT-2's Conv1D stores its weight (in, out) and computes x @ W + b, as
mpi_tp's linear layers do (y = x @ A + b, A (in, out)); the embeddings are (rows, C) in both.
The q|k|v order of c_attn's columns is that of transformers' split(n_embd, dim=2), and within
each part head h holds columns [h hs, (h + 1) hs), as mpi_tp's head split assumes.

LlamaForCausalLM (pre = "model.", or "" from LlamaModel), for each block i (mpi_tp.model.llama has the shapes):

    mpi_tp name (shape)            Hugging Face tensor (shape)               part
    wte (V, C)                   pre embed_tokens.weight (V, C)              whole
    h/i/ln_1/weight (C,)         pre layers.i.input_layernorm.weight         whole
    h/i/attn/q/weight (C, H hs)  pre layers.i.self_attn.q_proj.weight (H hs, C)    transposed
    h/i/attn/k/weight (C, H_kv hs)  pre layers.i.self_attn.k_proj.weight (H_kv hs, C)    transposed
    h/i/attn/v/weight (C, H_kv hs)  pre layers.i.self_attn.v_proj.weight (H_kv hs, C)    transposed
    h/i/attn/proj/weight (H hs, C) pre layers.i.self_attn.o_proj.weight (C, H hs)    transposed
    h/i/ln_2/weight (C,)         pre layers.i.post_attention_layernorm.weight      whole
    h/i/mlp/gate/weight (C, F)   pre layers.i.mlp.gate_proj.weight (F, C)    transposed
    h/i/mlp/up/weight (C, F)     pre layers.i.mlp.up_proj.weight (F, C)      transposed
    h/i/mlp/down/weight (F, C)   pre layers.i.mlp.down_proj.weight (C, F)    transposed
    ln_f/weight (C,)             pre norm.weight (C,)                        whole
    lm_head (V, C)                 lm_head.weight (V, C)                     whole; absent when tied (wte serves)

Qwen2ForCausalLM: Llama's names, and h/i/attn/{q,k,v}/bias (H hs,) / (H_kv hs,) = layers.i.self_attn.{q,k,v}_proj.bias.

MixtralForCausalLM: Llama's names, but each block's MLP is a mixture of experts (moe = pre layers.i.block_sparse_moe,
the names transformers' save_pretrained writes and the Hub's Mixtral folders hold):

    h/i/moe/router/weight (C, E)            moe.gate.weight (E, C)                      transposed
    h/i/moe/experts/e/gate/weight (C, F)    moe.experts.e.w1.weight (F, C)              transposed
    h/i/moe/experts/e/up/weight (C, F)      moe.experts.e.w3.weight (F, C)              transposed
    h/i/moe/experts/e/down/weight (F, C)    moe.experts.e.w2.weight (C, F)              transposed

Export writes these. transformers 5 fuses each block's experts in memory, and save_pretrained(...,
save_original_format=False) writes them so (mlp = pre layers.i.mlp; read, never written: `fused`):

    h/i/moe/router/weight (C, E)            mlp.gate.weight (E, C)                      transposed
    h/i/moe/experts/e/gate/weight (C, F)    mlp.experts.gate_up_proj (E, 2F, C)         [e, 0:F, :] transposed
    h/i/moe/experts/e/up/weight (C, F)          "                                       [e, F:2F, :] transposed
    h/i/moe/experts/e/down/weight (F, C)    mlp.experts.down_proj (E, C, F)             [e] transposed

torch.nn.Linear stores (out, in) and computes x W^T: each linear weight is the transpose of
mpi_tp's (in, out). A rank's column shard of q (its heads) is a block of q_proj's rows, so a
shard is still one contiguous read. The rotary pairing (rotate_half) and the head order are
transformers' own (mpi_tp.model.llama): no permutation of q_proj or k_proj.

A `Piece` says where an mpi_tp tensor lies in a Hugging Face one: the tensor, the axis along
which it is one part of several (None: it is the whole tensor), the part's offset on that
axis, and whether the two are stored transposed ((in, out) against (out, in): not in GPT-2;
a torch.nn.Linear weight would be); for fused experts, the expert's index on the tensor's first
axis (the rest of the Piece then describes the (2F, C) or (C, F) matrix under it).
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi_tp.model.config import GPTConfig

# Tensors that hold no parameter: the causal-mask buffers older transformers saved in GPT-2 folders
# ("h.i.attn.bias" (1, 1, n_positions, n_positions), "h.i.attn.masked_bias"), the rotary frequencies older
# Llama folders hold ("layers.i.self_attn.rotary_emb.inv_freq"), and the head of a tied model.
IGNORED_SUFFIXES = {"gpt2": (".attn.bias", ".attn.masked_bias"), "llama": (".rotary_emb.inv_freq",)}
TIED_HEAD = "lm_head.weight"
# The prefixes a folder's names may carry (the *ForCausalLM's, or none: saved from the bare model), and the
# token table's name after it, by which the prefix is recognised.
PREFIXES = {"gpt2": (("transformer.", ""), "wte.weight"), "llama": (("model.", ""), "embed_tokens.weight")}
LLAMA_LAYER = {                 # mpi_tp name in block i -> (LlamaForCausalLM's in layers.i, transposed)
    "ln_1/weight": ("input_layernorm.weight", False), "attn/q/weight": ("self_attn.q_proj.weight", True),
    "attn/k/weight": ("self_attn.k_proj.weight", True), "attn/v/weight": ("self_attn.v_proj.weight", True),
    "attn/proj/weight": ("self_attn.o_proj.weight", True), "ln_2/weight": ("post_attention_layernorm.weight", False),
    "mlp/gate/weight": ("mlp.gate_proj.weight", True), "mlp/up/weight": ("mlp.up_proj.weight", True),
    "mlp/down/weight": ("mlp.down_proj.weight", True)}

MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}      # an expert's SwiGLU in MixtralForCausalLM


@dataclass(frozen=True)
class Piece:
    tensor: str                 # the Hugging Face tensor's name
    part_axis: int | None       # the axis along which this is one part of the tensor (None: whole)
    offset: int = 0             # where the part starts on part_axis
    length: int = 0             # and its length there
    transposed: bool = False    # stored (out, in) there, (in, out) here
    expert: int | None = None   # fused experts: the index on the tensor's first axis (E)


def gpt2_pieces(cfg: GPTConfig, prefix: str = "transformer.") -> dict[str, Piece]:
    """mpi_tp parameter name -> its Piece of a GPT2LMHeadModel folder, for every parameter of the model."""
    C, pre = cfg.n_embd, prefix
    out = {"wte": Piece(f"{pre}wte.weight", None), "wpe": Piece(f"{pre}wpe.weight", None),
           "ln_f/weight": Piece(f"{pre}ln_f.weight", None), "ln_f/bias": Piece(f"{pre}ln_f.bias", None)}
    for n in range(cfg.n_layer):
        ours, theirs = f"h/{n}", f"{pre}h.{n}"
        for kind in ("weight", "bias"):
            axis = 1 if kind == "weight" else 0                      # c_attn: weight (C, 3C), bias (3C,)
            for j, part in enumerate("qkv"):
                out[f"{ours}/attn/{part}/{kind}"] = Piece(f"{theirs}.attn.c_attn.{kind}", axis, j * C, C)
            for mine, hf in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn/proj", "attn.c_proj"),
                             ("mlp/fc", "mlp.c_fc"), ("mlp/proj", "mlp.c_proj")):
                out[f"{ours}/{mine}/{kind}"] = Piece(f"{theirs}.{hf}.{kind}", None)
    return out


def llama_pieces(cfg: GPTConfig, prefix: str = "model.", fused: bool = False) -> dict[str, Piece]:
    """mpi_tp parameter name -> its Piece of a LlamaForCausalLM (MixtralForCausalLM, with experts; fused: those
    experts as transformers 5 fuses them) folder, for every parameter of the model."""
    out = {"wte": Piece(f"{prefix}embed_tokens.weight", None), "ln_f/weight": Piece(f"{prefix}norm.weight", None)}
    for n in range(cfg.n_layer):
        moe = cfg.is_moe_block(n)
        for ours, (theirs, transposed) in LLAMA_LAYER.items():
            if not (moe and ours.startswith("mlp/")):
                out[f"h/{n}/{ours}"] = Piece(f"{prefix}layers.{n}.{theirs}", None, transposed=transposed)
        if cfg.qkv_bias:                                             # Qwen2: q_proj.bias, ... (H hs,), whole
            for part in "qkv":
                out[f"h/{n}/attn/{part}/bias"] = Piece(f"{prefix}layers.{n}.self_attn.{part}_proj.bias", None)
        if moe:
            out.update(_mixtral_block(cfg, f"h/{n}/moe", f"{prefix}layers.{n}", fused))
    if not cfg.tied:
        out["lm_head"] = Piece(TIED_HEAD, None)
    return out


def _mixtral_block(cfg: GPTConfig, ours: str, theirs: str, fused: bool) -> dict[str, Piece]:
    """The Pieces of MoE block `ours` ("h/i/moe") in Mixtral's layer `theirs` ("model.layers.i")."""
    if not fused:
        block = f"{theirs}.block_sparse_moe"
        out = {f"{ours}/router/weight": Piece(f"{block}.gate.weight", None, transposed=True)}
        for e in range(cfg.moe_experts):
            for mine, w in MIXTRAL_EXPERT.items():
                out[f"{ours}/experts/{e}/{mine}/weight"] = Piece(f"{block}.experts.{e}.{w}.weight", None,
                                                                 transposed=True)
        return out
    F, experts = cfg.ffn, f"{theirs}.mlp.experts"
    out = {f"{ours}/router/weight": Piece(f"{theirs}.mlp.gate.weight", None, transposed=True)}
    for e in range(cfg.moe_experts):                # gate_up_proj[e] (2F, C): gate's F rows, then up's
        for j, part in enumerate(("gate", "up")):
            out[f"{ours}/experts/{e}/{part}/weight"] = Piece(f"{experts}.gate_up_proj", 1, j * F, F,
                                                             transposed=True, expert=e)
        out[f"{ours}/experts/{e}/down/weight"] = Piece(f"{experts}.down_proj", None, transposed=True, expert=e)
    return out


def pieces(cfg: GPTConfig, prefix: str | None = None, fused: bool = False) -> dict[str, Piece]:
    """mpi_tp parameter name -> its Piece, for the configuration's architecture (prefix None: the usual one;
    fused: a Mixtral's experts as transformers 5 fuses them)."""
    prefix = PREFIXES[cfg.arch][0][0] if prefix is None else prefix
    return llama_pieces(cfg, prefix, fused) if cfg.llama else gpt2_pieces(cfg, prefix)


def hf_shapes(cfg: GPTConfig, prefix: str | None = None, fused: bool = False) -> dict[str, tuple]:
    """Every Hugging Face tensor a folder of this configuration holds (a tied lm_head left out): its shape,
    in the model's order (fused: a Mixtral's experts as transformers 5 fuses them)."""
    prefix = PREFIXES[cfg.arch][0][0] if prefix is None else prefix
    if cfg.llama:
        from mpi_tp.model.llama import parameter_shapes
        table, shapes = llama_pieces(cfg, prefix, fused), {}
        E, C, F = cfg.moe_experts, cfg.n_embd, cfg.ffn
        fused_shapes = {"gate_up_proj": (E, 2 * F, C), "down_proj": (E, C, F)}
        for name, shape in parameter_shapes(cfg).items():
            piece = table[name]
            if piece.expert is not None:                         # the whole (E, ...) tensor, once
                shapes[piece.tensor] = fused_shapes[piece.tensor.rpartition(".")[2]]
            else:
                shapes[piece.tensor] = tuple(reversed(shape)) if piece.transposed else tuple(shape)
        return shapes
    C, V, S, F = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.ffn
    shapes = {f"{prefix}wte.weight": (V, C), f"{prefix}wpe.weight": (S, C),
              f"{prefix}ln_f.weight": (C,), f"{prefix}ln_f.bias": (C,)}
    for n in range(cfg.n_layer):
        h = f"{prefix}h.{n}"
        shapes.update({f"{h}.ln_1.weight": (C,), f"{h}.ln_1.bias": (C,), f"{h}.ln_2.weight": (C,),
                       f"{h}.ln_2.bias": (C,), f"{h}.attn.c_attn.weight": (C, 3 * C),
                       f"{h}.attn.c_attn.bias": (3 * C,), f"{h}.attn.c_proj.weight": (C, C),
                       f"{h}.attn.c_proj.bias": (C,), f"{h}.mlp.c_fc.weight": (C, F),
                       f"{h}.mlp.c_fc.bias": (F,), f"{h}.mlp.c_proj.weight": (F, C),
                       f"{h}.mlp.c_proj.bias": (C,)})
    return shapes


def region(piece: Piece, ndim: int, axis: int | None = None, start: int = 0, stop: int = 0) -> tuple:
    """The index into the piece's Hugging Face tensor (ndim axes) that holds the piece or, when axis is
    given, its rows/columns [start, stop) along mpi_tp's axis `axis` (a rank's shard)."""
    lead = () if piece.expert is None else (piece.expert,)     # a fused expert: its matrix under [e]
    ndim -= len(lead)
    idx = [slice(None)] * ndim
    flip = (lambda a: ndim - 1 - a) if piece.transposed else (lambda a: a)
    if piece.part_axis is not None:
        a = flip(piece.part_axis)
        idx[a] = slice(piece.offset, piece.offset + piece.length)
    if axis is not None:
        a = flip(axis)
        base = idx[a].start or 0
        idx[a] = slice(base + start, base + stop)
    return lead + tuple(idx)
