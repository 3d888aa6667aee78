"""`mpi-tp plan`'s model shape: GPT-2 or Llama, named as `mpi-tp train` names them, or read off a model.

    mpi-tp plan ... --arch llama --n-kv-head 8 --intermediate-size 14336 [--tie-embeddings]
    mpi-tp plan --model meta-llama/Llama-3.1-8B/ --seq 8192 --global-batch 512   # config.json, its folder,
    mpi-tp plan --model runs/x/checkpoints --global-batch 64                     # or an mpi_tp checkpoint

--model reads the shape (layers, channels, heads, key/value heads, MLP width, tied or not, vocabulary, the
experts of a mixture, and the longest sequence as --seq's default) from a Hugging Face config.json
(mpi_tp.checkpoint.hf.config maps it to a GPTConfig) or an mpi_tp checkpoint's saved configuration; every
option given on the command line overrides what the model says. Pricing: mpi_tp.planning.workload.
"""
from __future__ import annotations

import json
import os

from mpi_tp.checkpoint.format import CheckpointError
from mpi_tp.core.errors import UserError
from mpi_tp.model.config import ARCHS, GPTConfig
from mpi_tp.planning.attention_cost import KINDS

# plan's option -> GPTConfig's field, for what --model fills in when the option is not given
FROM_MODEL = (("layers", "n_layer"), ("hidden", "n_embd"), ("heads", "n_head"), ("seq", "block_size"),
              ("vocab", "vocab_size"), ("arch", "arch"), ("n_kv_head", "n_kv_head"),
              ("intermediate_size", "intermediate_size"), ("tie_embeddings", "tie_word_embeddings"))
MOE_FROM_MODEL = (("experts", "moe_experts"), ("top_k", "moe_top_k"), ("moe_every", "moe_every"),
                  ("shared_experts", "moe_shared_experts"), ("moe_capacity", "moe_capacity"))


def add_shape_arguments(p) -> None:
    """The shape options on the plan parser (defaults None: the architecture's, or --model's), and how the run
    computes: its attention kernel, and whether its tensor-parallel collectives overlap the GEMMs."""
    p.add_argument("--model", metavar="PATH", default=None,
                   help="read the model's shape from a Hugging Face config.json (or its folder) or an mpi_tp "
                        "checkpoint; options given override it (--seq defaults to the model's longest sequence)")
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="gpt2 (default: GELU MLP 4C wide, biases, learned positions, tied output layer) or llama "
                        "(SwiGLU MLP, grouped-query attention, RMSNorm, rotary positions, no biases, untied output "
                        "layer unless --tie-embeddings), as `mpi-tp train --arch`")
    p.add_argument("--n-kv-head", type=int, default=None,
                   help="llama: key/value heads H_kv, dividing --heads (fewer: grouped-query attention; "
                        "default: the heads)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="the MLP's width F (default 4C for gpt2, 8C/3 rounded up to a multiple of 8 for llama)")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--untie-embeddings", dest="tie_embeddings", action="store_false", default=None,
                     help="llama: the output layer its own table lm_head (llama's default)")
    tie.add_argument("--tie-embeddings", dest="tie_embeddings", action="store_true", default=None,
                     help="llama: the output layer tied to the token table wte (as gpt2 always is)")
    p.add_argument("--attention", choices=KINDS, default="auto",
                   help="the attention kernel priced: flash (no scores kept, the causal half computed, fused), stored "
                        "(Megatron's softmax of 2021-22: the (S, S) scores computed whole and kept), mpi_tp (this "
                        "code's CPU kernels); auto: flash on the GPU presets, mpi_tp on a calibrated machine "
                        "(mpi_tp.planning.attention_cost)")
    p.add_argument("--overlap-tp", action="store_true",
                   help="price the tensor-parallel collectives overlapped with the GEMMs as Transformer Engine's "
                        "userbuffers run them (Megatron --tp-comm-overlap; inside a node, a quarter exposed): for "
                        "planning a Megatron run; mpi_tp's engine does not overlap them")


def model_config(path: str) -> GPTConfig:
    """The GPTConfig of a Hugging Face config.json, a folder holding one, or an mpi_tp checkpoint (a root or a
    step-N folder); one UserError naming the path and what to pass otherwise."""
    from mpi_tp.checkpoint.hf.config import gpt_config
    from mpi_tp.checkpoint.read import Checkpoint
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    json_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    try:
        if os.path.isfile(json_file) and not os.path.isfile(os.path.join(folder, "index.h5")):
            with open(json_file) as f:
                hf = json.load(f)
            if not isinstance(hf, dict) or "model_type" not in hf:
                raise CheckpointError(f"{json_file} is not a Hugging Face model's config.json (no model_type)")
            return gpt_config(hf, json_file)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} does not exist")
        with Checkpoint(path) as ck:
            return GPTConfig(**ck.meta["config"])
    except (OSError, ValueError, TypeError) as e:     # CheckpointError and HFConfigError are ValueErrors
        raise UserError(f"--model {path}: {e}" + ("" if isinstance(e, CheckpointError) else " (unreadable)") +
                        "; pass a Hugging Face config.json or its folder, or an mpi_tp checkpoint (or give the "
                        "shape with --layers --hidden --heads ...)") from None


def apply_model(args) -> None:
    """Fill the options not given (None) from --model's configuration (its mixture of experts unless
    --moe-experts is given)."""
    cfg = model_config(args.model).resolved()
    for ours, theirs in FROM_MODEL:
        if getattr(args, ours) is None:
            setattr(args, ours, getattr(cfg, theirs))
    if cfg.moe_experts and not args.experts:
        for ours, theirs in MOE_FROM_MODEL:
            setattr(args, ours, getattr(cfg, theirs))


def check_shape(args) -> dict:
    """The shape options checked (one UserError naming the flag); Workload's fields from them."""
    arch = args.arch or "gpt2"
    if arch != "llama" and (args.n_kv_head not in (None, args.heads) or args.tie_embeddings is False):
        raise UserError("--n-kv-head and --untie-embeddings are llama's (arch gpt2 gives every head its own k and v "
                        "and ties its output layer): add --arch llama")
    if args.n_kv_head is not None and (args.n_kv_head < 1 or args.heads % args.n_kv_head):
        raise UserError(f"--n-kv-head {args.n_kv_head} must be at least 1 and divide --heads {args.heads} (each "
                        "key/value head serves heads / n-kv-head query heads)")
    if args.intermediate_size is not None and args.intermediate_size < 1:
        raise UserError(f"--intermediate-size must be at least 1, got {args.intermediate_size}")
    return dict(arch=arch, n_kv_head=args.n_kv_head, intermediate_size=args.intermediate_size,
                tie_embeddings=args.tie_embeddings)
