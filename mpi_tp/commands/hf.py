"""Hugging Face models in and out: `import-hf` (a GPT-2 or Llama folder -> a sharded mpi_tp checkpoint) and
`export --format hf` (a checkpoint -> a folder transformers loads).

    mpiexec -n 2 mpi-tp import-hf gpt2-folder runs/gpt2/checkpoints     # shards at tp = 2
    mpiexec -n 2 mpi-tp eval --checkpoint runs/gpt2/checkpoints --data notes.txt
    mpi-tp export runs/X/checkpoints gpt2-folder --format hf [--dtype bfloat16]

A folder's format is its tensors' (a BF16 folder imports as a bf16 checkpoint, its 16-bit words unchanged,
and exports back byte for byte); import-hf --precision and export --dtype choose another, widening exactly
or rounding each value once (to nearest, ties to even; fp16 refuses values past 65504).

eval, generate, serve and `train --init-from` also take the folder itself (each rank
reads its slices from the safetensors files: mpi_tp.checkpoint.hf.read). The
vocabulary stays the folder's (50257 for GPT-2), and text goes through the
folder's tokenizer.json (mpi_tp.text.tokenizer), which an import keeps in its
checkpoint and an export writes back with the eos ids.
The `export` command is mpi_tp.commands.checkpoints: it takes --format hf's options from here
(add_export_arguments) and calls export_hf. The model loads with mpi_tp.checkpoint.model.
"""
from __future__ import annotations

import os
import shutil

from mpi_tp import checkpoint as ckpt_io
from mpi_tp.checkpoint.format import put_in_place
from mpi_tp.checkpoint.hf import hf_config, is_hf_folder
from mpi_tp.checkpoint.hf.write import (
    DEFAULT_SHARD_BYTES,
    EXPORT_DTYPES,
    export,
    export_dtype,
)
from mpi_tp.checkpoint.model import load_model
from mpi_tp.commands.common import add_format_arguments, model_dtype
from mpi_tp.core.errors import UserError, refuse_to_replace
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.model.config import GPTConfig


def import_folder(folder: str, out: str, comm, dtype: str | None = None, overwrite: bool = False) -> str:
    """Write the Hugging Face model `folder` as the mpi_tp checkpoint root `out` (one step, 0) at
    tensor-parallel size = comm's size, in `dtype` (None: the folder's own format); collective. Returns the
    step folder."""
    def check():
        if not is_hf_folder(folder):
            raise UserError(f"import-hf: {folder} is not a Hugging Face model folder (config.json and "
                            "model.safetensors, or model.safetensors.index.json and its shards)")
        if comm.Get_rank() == 0:
            refuse_to_replace(out, overwrite, "import-hf")
            shutil.rmtree(staging, ignore_errors=True)       # what an interrupted import left
    staging = out.rstrip(os.sep) + ".importing"
    collective_setup(check, comm=comm)
    model, ck = load_model(folder, comm, dtype)
    meta = {"config": model.cfg.to_dict(), "source": ck.meta["source"]}
    tokenizer = collective_setup(ck.tokenizer, comm=comm)          # the folder's tokenizer.json, kept in the index
    ckpt_io.save(staging, 0, model, None, meta, tokenizer=tokenizer)

    def publish():                    # the new checkpoint takes OUT's place only once it is complete
        if comm.Get_rank() != 0:
            return
        try:                          # rank 0 alone, between collectives: a failure is a message to all
            put_in_place(staging, out)
        except OSError as e:
            raise UserError(f"import-hf: cannot put the checkpoint at {out} ({e.strerror or e}); it is "
                            f"complete at {staging}") from None
    collective_setup(publish, comm=comm)      # (ends in an allgather: every rank waits for the rename)
    return os.path.join(out, ckpt_io.step_dir_name(0))


def cmd_import_hf(args, comm) -> int:
    step = import_folder(args.folder, args.out, comm, model_dtype(args), args.overwrite)
    with ckpt_io.Checkpoint(step) as ck:
        dtype = ck.meta["dtypes"]
    rank0_print(f"imported {os.path.normpath(args.folder)} into {step}: {comm.Get_size()} shard(s), "
                f"tp={comm.Get_size()}, {dtype}", comm=comm)
    return 0


def export_hf(args) -> int:
    """`mpi-tp export CKPT OUT --format hf` (rank 0)."""
    with ckpt_io.Checkpoint(args.checkpoint) as ck:
        files = export(ck, args.out, args.overwrite, int(args.max_shard_mb * 10**6), args.dtype)
        dtype = export_dtype(ck, args.dtype).name
    kind = hf_config(GPTConfig(**ck.meta["config"]), dtype)["architectures"][0]
    print(f"wrote {args.out}: {', '.join(files)} (Hugging Face {kind}, {dtype}) from {ck.dir} (step {ck.step})")
    return 0


def add_parser(sub) -> None:
    i = sub.add_parser("import-hf", help="a Hugging Face GPT-2 or Llama folder as a sharded mpi_tp checkpoint",
                       description="Read a Hugging Face GPT-2 or Llama folder (config.json, model.safetensors or its "
                                   "shards) and write it as an mpi_tp checkpoint at tensor-parallel size = "
                                   "world size: mpiexec -n T mpi-tp import-hf FOLDER OUT. Each rank reads "
                                   "only its slices.")
    i.add_argument("folder", help="the Hugging Face model folder")
    i.add_argument("out", help="the checkpoint folder to write (its step-00000000)")
    add_format_arguments(i, "the folder's: its tensors' dtype, bf16 for a BF16 folder (the widest present if "
                            "they differ)")
    i.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (the new checkpoint "
                   "takes its place only once it is complete)")
    i.set_defaults(run=cmd_import_hf)


def add_export_arguments(x) -> None:
    """export's options for --format hf."""
    x.add_argument("--format", choices=["h5", "npz", "hf"], help="h5 or npz: one file of full tensors "
                   "(default: by OUT's extension); hf: a Hugging Face folder, GPT-2 or Llama (config.json and "
                   "model.safetensors) that transformers loads")
    x.add_argument("--dtype", choices=EXPORT_DTYPES, help="--format hf: the tensors' dtype (default: the "
                   "checkpoint's). Widening is exact; narrowing rounds each value once to the nearest (ties to even), "
                   "and fp16 refuses values past its largest, 65504")
    x.add_argument("--max-shard-mb", type=float, default=DEFAULT_SHARD_BYTES / 10**6,
                   help="--format hf: cut model.safetensors into shards of at most this many MB "
                        f"(default {DEFAULT_SHARD_BYTES // 10**6})")
