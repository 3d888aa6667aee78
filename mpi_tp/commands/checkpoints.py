"""Commands on saved checkpoints: eval, generate (at any world size), inspect and export.

    mpiexec -n 2 mpi-tp eval --checkpoint runs/X/checkpoints --data notes.txt [--json]
    mpiexec -n 2 mpi-tp generate --checkpoint runs/X/checkpoints --prompt "The " [--prompt "Once" ...]
    mpiexec -n 2 mpi-tp generate --checkpoint runs/X/checkpoints --backend cupy   # one GPU per rank
    mpi-tp inspect runs/X/checkpoints           # layout, tensors, full integrity check
    mpi-tp export runs/X/checkpoints model.h5   # one self-contained file of full tensors (.h5 or .npz)
    mpi-tp export runs/X/checkpoints gpt2-folder --format hf    # a folder transformers loads
    mpiexec -n 2 mpi-tp generate --checkpoint gpt2-folder --precision bf16   # 16-bit weights and KV cache

eval and generate rebuild the saved model at tensor-parallel size = world size,
whatever size saved it (or read a Hugging Face folder: mpi_tp.commands.hf), on the
array backend of --backend (numpy, or cupy: one GPU per rank, chosen before any
array is made), and read text with the model's own tokenizer (the folder's
tokenizer.json, or the one the checkpoint keeps; bytes when it has none;
--tokenizer to choose another): mpi_tp.checkpoint.model loads both, and
mpi_tp.inference.evaluate computes eval's loss. inspect and export work on rank 0;
export --format hf is mpi_tp.commands.hf's, and so is import-hf. --precision (mpi_tp.commands.common) loads
the model in fp32, bf16 or fp16 whatever it was saved in (mpi_tp.checkpoint.model says how values convert).
"""
from __future__ import annotations

import json
import os
import sys

import h5py
import numpy

from mpi_tp import checkpoint as ckpt_io
from mpi_tp.checkpoint.format import stored
from mpi_tp.checkpoint.model import load_model, model_tokenizer
from mpi_tp.commands import hf
from mpi_tp.commands.common import (
    add_model_arguments,
    model_dtype,
    on_rank0,
    use_backend,
)
from mpi_tp.core.errors import UserError, refuse_to_replace
from mpi_tp.core.precision import dtype_of
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.commands.common import model_ids
from mpi_tp.inference.evaluate import evaluate_file
from mpi_tp.inference.generate import Request, generate
from mpi_tp.inference.sampling import printable
from mpi_tp.training.data import load_corpus


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError(f"must be at least 1, got {n}")
    return n


def _positive_float(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise ValueError(f"must be positive, got {x}")
    return x


def cmd_eval(args, comm) -> int:
    use_backend(args, comm)
    corpus = collective_setup(load_corpus, args.data, comm=comm)
    model, ck = load_model(args.checkpoint, comm, model_dtype(args))
    tok = model_tokenizer(args.tokenizer, ck, comm)
    tokens = collective_setup(model_ids, corpus, tok, model.cfg.vocab_size, f"--data {args.data}",
                              f"the model at {args.checkpoint}", comm=comm)
    loss, n = collective_setup(evaluate_file, model, tokens, args.batch_size, comm=comm)
    result = {"loss": loss, "tokens": n, "checkpoint": ck.dir, "step": ck.step, "data": corpus.source,
              "data_sha256": corpus.sha256, "tokenizer": tok.kind, "tp": model.topo.tp.size, "dtype": str(model.dtype)}
    if args.json:
        rank0_print(json.dumps(result), comm=comm)
    else:
        rank0_print(f"{ck.dir} (step {ck.step}) on {corpus.name}: {loss:.6f} nats/token over {n:,} "
                    f"tokens (perplexity {numpy.exp(loss):.3f}), tp={result['tp']}, {result['dtype']}",
                    comm=comm)
    return 0


def cmd_generate(args, comm) -> int:
    """Every prompt continued, in one batch, with a KV cache (mpi_tp.inference.generate); a prompt
    longer than block_size keeps its last block_size tokens (said on stderr)."""
    use_backend(args, comm)
    model, ck = load_model(args.checkpoint, comm, model_dtype(args), args.ep)
    tok = model_tokenizer(args.tokenizer, ck, comm)
    S = model.cfg.block_size
    prompts = [tok.encode(p) for p in (args.prompt or ["The "])]
    if any(len(p) > S for p in prompts):
        rank0_print(f"generate: prompts longer than block_size = {S} tokens keep their last {S}", comm=comm,
                    file=sys.stderr)
    requests = [Request(p[-S:], args.max_new_tokens, 0.0 if args.greedy else args.temperature, args.top_k,
                        args.top_p, args.seed + i) for i, p in enumerate(prompts)]
    collective_setup(lambda: [r.check(S, model.cfg.vocab_size) for r in requests], comm=comm)
    for r, new in zip(requests, generate(model, requests, tokenizer=tok)):
        shown = bytes(r.prompt) if tok.kind == "bytes" else tok.decode(r.prompt).encode()
        rank0_print(printable(shown + new), comm=comm)
    return 0


def cmd_inspect(args, comm) -> int:
    def run():
        with ckpt_io.Checkpoint(args.checkpoint) as ck:
            m = ck.meta
            print(f"checkpoint {ck.dir}")
            print(f"  format {ckpt_io.FORMAT} v{ckpt_io.VERSION}; step {ck.step}; saved at {' x '.join(f'{k}={v}' for k, v in m['layout'].items() if k != 'world')}; "
                  f"data {m.get('data', {}).get('name')} (sha256 {str(m.get('data', {}).get('sha256'))[:12]})")
            print(f"  model {json.dumps(m['config'])}")
            total = 0
            print(f"  {'tensor':<34} {'shape':>14} {'dtype':>8} {'MB':>8}  split")
            for name, t in ck.tensors.items():
                nbytes = int(numpy.prod(t["shape"])) * dtype_of(t["dtype"]).itemsize
                total += nbytes
                split = "replicated" if t["axis"] is None else \
                    f"axis {t['axis']}: " + " ".join(f"{a}:{b}" for _, a, b in t["pieces"])
                print(f"  {name:<34} {str(tuple(t['shape'])):>14} {dtype_of(t['dtype']).name:>8} "
                      f"{nbytes / 1e6:>8.3f}  {split}")
            print(f"  {len(ck.tensors)} tensors, {total / 1e6:.2f} MB in {len(ck.shards)} shards")
            problems = ck.verify()
        for p in problems:
            print(f"  PROBLEM: {p}")
        print("  integrity: " + ("OK (every shard's SHA-256 and every dataset's checksum)" if not problems
                                 else f"{len(problems)} problem(s)"))
        return 1 if problems else 0
    return on_rank0(run, comm)


def cmd_export(args, comm) -> int:
    def run():
        out = args.out
        if args.format == "hf":
            return hf.export_hf(args)
        if args.dtype is not None:
            raise UserError(f"export --dtype {args.dtype}: only --format hf converts; an .h5 or .npz export keeps "
                            "the checkpoint's tensors as they are")
        ext = "npz" if out.endswith(".npz") else "h5" if out.endswith((".h5", ".hdf5")) else None
        if ext is None or args.format not in (None, ext):
            raise UserError(f"export: {out!r} should end in .h5 or .npz (or pass --format hf for a Hugging "
                            "Face folder)")
        refuse_to_replace(out, args.overwrite, "export")
        if os.path.isdir(out):
            raise UserError(f"export: {out} is a folder: give a file name")
        with ckpt_io.Checkpoint(args.checkpoint) as ck:
            # bfloat16 tensors as their uint16 words, as in the checkpoint (neither HDF5 nor .npz has bfloat16);
            # meta/bfloat16 lists them
            tensors = {name: stored(ck.read(name)) for name in ck.tensors
                       if args.optimizer or name.startswith("model/")}
            half = [name for name in tensors if ck.tensors[name]["dtype"] == "bfloat16"]
            meta = {k: json.dumps(v) for k, v in ck.meta.items()}
            if half:
                meta["bfloat16"] = json.dumps(half)
        tmp = out + ".tmp" + (".npz" if out.endswith(".npz") else "")
        if out.endswith(".npz"):
            numpy.savez(tmp, **tensors, **{f"meta/{k}": numpy.array(v) for k, v in meta.items()})
        else:
            with h5py.File(tmp, "w") as f:
                for k, v in meta.items():
                    f.attrs[k] = v
                for name, value in tensors.items():
                    f.create_dataset(name, data=value)
        os.replace(tmp, out)          # a half-written export never takes the place of a good one
        print(f"wrote {out}: {len(tensors)} full tensors from {ck.dir} (step {ck.step})")
        return 0
    return on_rank0(run, comm)


def add_parsers(sub) -> None:
    e = sub.add_parser("eval", help="mean next-token cross-entropy of a checkpoint on a text file",
                       description="Mean next-token cross-entropy (nats per token) of a saved model on a "
                                   "text: windows of block_size + 1 bytes starting at 0, S, 2S, ...")
    e.add_argument("--checkpoint", required=True, help="checkpoint folder (its latest step), a step-N folder, or a "
                   "Hugging Face GPT-2 or Llama folder")
    e.add_argument("--data", required=True, help="text file (or 'pydoc' / 'shakespeare')")
    e.add_argument("--json", action="store_true", help="print one JSON line")
    e.add_argument("--batch-size", type=_positive, default=16, help="windows per forward pass (default 16)")
    add_model_arguments(e)
    e.set_defaults(run=cmd_eval)
    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument("--checkpoint", required=True, help="checkpoint folder, a step-N folder, or a Hugging Face "
                   "GPT-2, Llama or Mixtral folder")
    g.add_argument("--prompt", action="append", help="text to continue (default 'The '); repeat it for a "
                   "batch of prompts, generated together")
    g.add_argument("--max-new-tokens", type=_positive, default=200, help="tokens to generate (default 200)")
    g.add_argument("--temperature", type=_positive_float, default=0.8, help="sampling temperature (default 0.8)")
    g.add_argument("--greedy", action="store_true", help="always the likeliest token (the same as --top-k 1)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens whose probability "
                   "reaches p (default 1: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (the i-th: seed + i)")
    g.add_argument("--ep", type=_positive, default=1, help="a mixture of experts: its experts divided among ep "
                   "groups of the ranks, each expert split over ranks / ep of them (default 1: every rank holds a "
                   "slice of every expert)")
    add_model_arguments(g)
    g.set_defaults(run=cmd_generate)
    i = sub.add_parser("inspect", help="layout, tensors and a full integrity check of a checkpoint")
    i.add_argument("checkpoint", help="checkpoint folder or a step-N folder")
    i.set_defaults(run=cmd_inspect)
    x = sub.add_parser("export", help="write a checkpoint's full tensors to one .h5 or .npz file, or a Hugging "
                       "Face folder (--format hf)")
    x.add_argument("checkpoint", help="checkpoint folder or a step-N folder")
    x.add_argument("out", help="output file, .h5 or .npz; with --format hf, a folder")
    x.add_argument("--optimizer", action="store_true", help="include the optimizer state (optim/...)")
    x.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (the new file takes its "
                   "place only once it is complete)")
    hf.add_export_arguments(x)
    x.set_defaults(run=cmd_export)
