"""Which Hugging Face tensor holds each mpi_tp parameter, and where in it.

GPT2LMHeadModel (P = "transformer.", or "" in a folder saved from GPT2Model, such as the
original gpt2 release), C = n_embd, for each block N:

    mpi_tp name (shape)            Hugging Face tensor (shape)               part
    wte (V, C)                     P wte.weight (V, C)                       whole
    wpe (block_size, C)            P wpe.weight (n_positions, C)             whole
    h/N/ln_1/{weight,bias} (C,)    P h.N.ln_1.{weight,bias} (C,)             whole
    h/N/attn/q/weight (C, C)       P h.N.attn.c_attn.weight (C, 3C)          columns [0, C)
    h/N/attn/k/weight (C, C)         "                                       columns [C, 2C)
    h/N/attn/v/weight (C, C)         "                                       columns [2C, 3C)
    h/N/attn/{q,k,v}/bias (C,)     P h.N.attn.c_attn.bias (3C,)              [0, C), [C, 2C), [2C, 3C)
    h/N/attn/proj/weight (C, C)    P h.N.attn.c_proj.weight (C, C)           whole
    h/N/attn/proj/bias (C,)        P h.N.attn.c_proj.bias (C,)               whole
    h/N/ln_2/{weight,bias} (C,)    P h.N.ln_2.{weight,bias} (C,)             whole
    h/N/mlp/fc/weight (C, 4C)      P h.N.mlp.c_fc.weight (C, 4C)             whole
    h/N/mlp/fc/bias (4C,)          P h.N.mlp.c_fc.bias (4C,)                 whole
    h/N/mlp/proj/weight (4C, C)    P h.N.mlp.c_proj.weight (4C, C)           whole
    h/N/mlp/proj/bias (C,)         P h.N.mlp.c_proj.bias (C,)                whole
    ln_f/{weight,bias} (C,)        P ln_f.{weight,bias} (C,)                 whole
    (the tied output layer)        lm_head.weight (V, C): wte; not read, not written

No transposition: GPT-2's Conv1D stores its weight (in, out) and computes x @ W + b, as
mpi_tp's linear layers do (y = x @ A + b, A (in, out)); the embeddings are (rows, C) in both.
The q|k|v order of c_attn's columns is that of transformers' split(n_embd, dim=2), and within
each part head h holds columns [h hs, (h + 1) hs), as mpi_tp's head split assumes.

A `Piece` says where an mpi_tp tensor lies in a Hugging Face one: the tensor, the axis along
which it is one part of several (None: it is the whole tensor), the part's offset on that
axis, and whether the two are stored transposed ((in, out) against (out, in): not in GPT-2;
a torch.nn.Linear weight would be).
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi_tp.model.config import GPTConfig

# Tensors of a GPT-2 folder that hold no parameter: the causal-mask buffers older transformers saved
# ("h.N.attn.bias" (1, 1, n_positions, n_positions), "h.N.attn.masked_bias"), and the tied head.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Piece:
    tensor: str                 # the Hugging Face tensor's name
    part_axis: int | None       # the axis along which this is one part of the tensor (None: whole)
    offset: int = 0             # where the part starts on part_axis
    length: int = 0             # and its length there
    transposed: bool = False    # stored (out, in) there, (in, out) here


def gpt2_pieces(cfg: GPTConfig, prefix: str = "transformer.") -> dict[str, Piece]:
    """mpi_tp parameter name -> its Piece of a GPT2LMHeadModel folder, for every parameter of the model."""
    C, P = cfg.n_embd, prefix
    out = {"wte": Piece(f"{P}wte.weight", None), "wpe": Piece(f"{P}wpe.weight", None),
           "ln_f/weight": Piece(f"{P}ln_f.weight", None), "ln_f/bias": Piece(f"{P}ln_f.bias", None)}
    for n in range(cfg.n_layer):
        ours, theirs = f"h/{n}", f"{P}h.{n}"
        for kind in ("weight", "bias"):
            axis = 1 if kind == "weight" else 0                      # c_attn: weight (C, 3C), bias (3C,)
            for j, part in enumerate("qkv"):
                out[f"{ours}/attn/{part}/{kind}"] = Piece(f"{theirs}.attn.c_attn.{kind}", axis, j * C, C)
            for mine, hf in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn/proj", "attn.c_proj"),
                             ("mlp/fc", "mlp.c_fc"), ("mlp/proj", "mlp.c_proj")):
                out[f"{ours}/{mine}/{kind}"] = Piece(f"{theirs}.{hf}.{kind}", None)
    return out


def hf_shapes(cfg: GPTConfig, prefix: str = "transformer.") -> dict[str, tuple]:
    """Every Hugging Face tensor a GPT-2 folder of this configuration holds (lm_head left out): its shape."""
    C, V, S = cfg.n_embd, cfg.vocab_size, cfg.block_size
    shapes = {f"{prefix}wte.weight": (V, C), f"{prefix}wpe.weight": (S, C),
              f"{prefix}ln_f.weight": (C,), f"{prefix}ln_f.bias": (C,)}
    for n in range(cfg.n_layer):
        h = f"{prefix}h.{n}"
        shapes.update({f"{h}.ln_1.weight": (C,), f"{h}.ln_1.bias": (C,), f"{h}.ln_2.weight": (C,),
                       f"{h}.ln_2.bias": (C,), f"{h}.attn.c_attn.weight": (C, 3 * C),
                       f"{h}.attn.c_attn.bias": (3 * C,), f"{h}.attn.c_proj.weight": (C, C),
                       f"{h}.attn.c_proj.bias": (C,), f"{h}.mlp.c_fc.weight": (C, 4 * C),
                       f"{h}.mlp.c_fc.bias": (4 * C,), f"{h}.mlp.c_proj.weight": (4 * C, C),
                       f"{h}.mlp.c_proj.bias": (C,)})
    return shapes


def region(piece: Piece, ndim: int, axis: int | None = None, start: int = 0, stop: int = 0) -> tuple:
    """The index into the piece's Hugging Face tensor (ndim axes) that holds the piece or, when axis is
    given, its rows/columns [start, stop) along mpi_tp's axis `axis` (a rank's shard)."""
    idx = [slice(None)] * ndim
    flip = (lambda a: ndim - 1 - a) if piece.transposed else (lambda a: a)
    if piece.part_axis is not None:
        a = flip(piece.part_axis)
        idx[a] = slice(piece.offset, piece.offset + piece.length)
    if axis is not None:
        a = flip(axis)
        base = idx[a].start or 0
        idx[a] = slice(base + start, base + stop)
    return tuple(idx)
