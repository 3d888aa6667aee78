"""Writing an mpi_tp checkpoint as a Hugging Face folder (GPT-2, Llama, or Mixtral: a llama model with experts) that
transformers loads:

    mpi-tp export runs/X/checkpoints gpt2-folder --format hf
    transformers.AutoModelForCausalLM.from_pretrained("gpt2-folder")

    OUT/config.json                               GPT2LMHeadModel's or LlamaForCausalLM's (config.hf_config)
    OUT/model.safetensors                         every tensor under its Hugging Face name (names.py), or, past
    OUT/model-0000i-of-0000n.safetensors          max_shard_bytes, shards and their
    OUT/model.safetensors.index.json              weight_map
    OUT/tokenizer.json                            the tokenizer the checkpoint keeps (if any; its eos ids
                                                  go into config.json)

The tensors are in the checkpoint's dtype (a bf16 checkpoint: BF16, its 16-bit words as they are, so a BF16
folder imported and exported comes back byte for byte), or in `dtype` (export --dtype): widened exactly, or
each value rounded once to the nearest (ties to even; ml_dtypes and NumPy convert float64 directly); a value
that the new format cannot hold (fp16 past 65504) is refused by name, not written as inf.

Runs on one rank: each Hugging Face tensor is assembled from the checkpoint's full tensors
(GPT-2's c_attn from q, k and v; Llama's linear weights transposed), and one shard's tensors
are in memory at a time. The folder is written as OUT.tmp and renamed into place once complete, so a failed export never replaces
a good folder; an existing OUT is replaced only when asked (overwrite).
"""
from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy

from mpi_tp.checkpoint.format import CheckpointError, put_in_place
from mpi_tp.checkpoint.hf.config import hf_config
from mpi_tp.checkpoint.hf.mixtral import mixtral_refusal
from mpi_tp.checkpoint.hf.names import hf_shapes, pieces, region
from mpi_tp.checkpoint.hf.read import INDEX, SINGLE, require_safetensors
from mpi_tp.core.errors import refuse_to_replace
from mpi_tp.core.precision import dtype_of
from mpi_tp.model.config import GPTConfig

DEFAULT_SHARD_BYTES = 5 * 10**9           # save_pretrained's default shard size in transformers 4
EXPORT_DTYPES = ("float32", "bfloat16", "float16", "float64")     # export --dtype (safetensors F32, BF16, F16, F64)


def hf_tensors(cfg: GPTConfig) -> dict[str, list]:
    """Hugging Face tensor name -> [(mpi_tp name, Piece)] that make it up, in the folder's order."""
    parts = {name: [] for name in hf_shapes(cfg)}
    for ours, piece in pieces(cfg).items():
        parts[piece.tensor].append((ours, piece))
    return parts


def _assemble(ckpt, name: str, shape: tuple, parts: list, dtype):
    """Hugging Face tensor `name` in `dtype`, each value converted once; one CheckpointError if a finite value
    becomes inf (past the format's largest)."""
    full = numpy.empty(shape, dtype=dtype)
    for ours, piece in parts:
        values = ckpt.read(f"model/{ours}")
        with numpy.errstate(over="ignore"):                    # past the largest: inf, refused below
            full[region(piece, len(shape))] = values.T if piece.transposed else values
        if numpy.isfinite(values).all() and not numpy.isfinite(full[region(piece, len(shape))]).all():
            raise CheckpointError(f"export --dtype {dtype.name}: model/{ours} holds values past {dtype.name}'s "
                                  f"largest ({_largest(dtype):g}): export it as bfloat16 or float32")
    return full


def _largest(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)          # (NumPy's finfo has no bfloat16; ml_dtypes' knows both)


def export_dtype(ckpt, dtype: str | None = None):
    """The dtype export writes: `dtype` (one of EXPORT_DTYPES), or None: the checkpoint's own."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"export --dtype {dtype!r}: choose one of {', '.join(EXPORT_DTYPES)}")
    return dtype_of(dtype or ckpt.tensors["model/wte"]["dtype"])


def _shards(shapes: dict, itemsize: int, limit: int) -> list[list[str]]:
    """The tensors in order, cut into runs of at most `limit` bytes (a bigger tensor alone)."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = int(numpy.prod(shape)) * itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _check_mixtral(ckpt, cfg: GPTConfig) -> None:
    """One CheckpointError if MixtralForCausalLM cannot compute this mixture of experts: its config, or an
    aux-loss-free expert bias that has moved (it steers the choice; Mixtral's router has none)."""
    why = mixtral_refusal(cfg)
    if why is None:
        biases = [n for n in getattr(ckpt, "tensors", {}) if n.endswith("/router/expert_bias")]
        moved = [n for n in biases if numpy.any(ckpt.read(n) != 0)]
        why = (f"its router carries an expert bias ({moved[0]}, --moe-bias-rate) that steers the choice; "
               "Mixtral's router has none") if moved else None
    if why is not None:
        raise CheckpointError(f"export --format hf: {ckpt.dir} is a mixture of experts that MixtralForCausalLM "
                              f"cannot compute: {why}")


def export(ckpt, out: str, overwrite: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
           dtype: str | None = None) -> list[str]:
    """Write checkpoint `ckpt` (a Checkpoint) as the Hugging Face folder `out`, its tensors in `dtype` (one of
    EXPORT_DTYPES; None: the checkpoint's); returns its files."""
    refuse_to_replace(out, overwrite, "export")
    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckpointError(f"export: {out} is a file; a Hugging Face model is a folder: give a folder name")
    cfg = GPTConfig(**ckpt.meta["config"])
    if cfg.moe_experts:
        _check_mixtral(ckpt, cfg)
    require_safetensors()
    from safetensors.numpy import save_file
    dtype = export_dtype(ckpt, dtype)
    shapes, parts = hf_shapes(cfg), hf_tensors(cfg)
    shards = _shards(shapes, dtype.itemsize, max_shard_bytes)
    tmp = out.rstrip(os.sep) + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        file = SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        try:
            tensors = {name: _assemble(ckpt, name, shapes[name], parts[name], dtype) for name in names}
        except CheckpointError:
            shutil.rmtree(tmp, ignore_errors=True)          # a refused export leaves nothing behind
            raise
        save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})   # transformers asks "pt"
        weight_map.update({name: file for name in names})
        files.append(file)
    if len(shards) > 1:
        total = sum(int(numpy.prod(s)) * dtype.itemsize for s in shapes.values())
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append(INDEX)
    config, tokenizer = hf_config(cfg, dtype.name), ckpt.tokenizer()
    if tokenizer.kind != "bytes":          # the tokenizer.json the checkpoint keeps, and the ids that end a text
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8", newline="") as f:
            f.write(tokenizer.json_text)
        files.append("tokenizer.json")
        if tokenizer.eos_ids:
            config["eos_token_id"] = tokenizer.eos_ids[0] if len(tokenizer.eos_ids) == 1 else list(tokenizer.eos_ids)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    files.append("config.json")
    put_in_place(tmp, out)               # asked to replace it: the old one goes only once the new is whole
    return files
