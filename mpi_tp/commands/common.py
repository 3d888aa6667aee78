"""What several commands share: the options of the commands that run a saved model (eval, generate, serve:
--precision or --dtype, --tokenizer, --backend), model_dtype and use_backend, and `on_rank0` for the commands
that one process does under mpiexec (inspect, export, tokenize); model_ids, a corpus as a model's token ids
(eval, compare).

The model and its tokenizer come from the library (mpi_tp.checkpoint.model: load_model, model_tokenizer).
"""
from __future__ import annotations

import numpy

from mpi_tp.core import backend
from mpi_tp.core.precision import precision, storage_dtype
from mpi_tp.core.runtime import collective_setup
from mpi_tp.training.data import DataError

INFERENCE_PRECISIONS = ("fp32", "bf16", "fp16")       # --precision of eval, generate, serve, import-hf
PRECISION_HELP = ("the model's number format: fp32, bf16 or fp16 (default: {default}). A checkpoint saved wider "
                  "is rounded once on load (to nearest, ties to even; fp16 refuses weights past its largest, "
                  "65504), a narrower one widened exactly. At 16 bits every product accumulates in fp32 and is "
                  "rounded once, softmax and norms run in fp32, the KV cache holds 16-bit keys and values, and "
                  "sampling reads the 16-bit logits widened exactly. --dtype float64 is the exact mode")


def add_format_arguments(parser, default: str) -> None:
    """--precision or --dtype (one of the two): the format a saved model is loaded or written in; default: what
    the help says when neither is given (model_dtype returns None then)."""
    formats = parser.add_mutually_exclusive_group()
    formats.add_argument("--precision", choices=INFERENCE_PRECISIONS, help=PRECISION_HELP.format(default=default))
    formats.add_argument("--dtype", choices=["float32", "float64"], help=f"the dtype by name (default: {default})")


def model_dtype(args) -> str | None:
    """The dtype name --precision or --dtype asks for ('bfloat16' for bf16), or None: as saved."""
    if getattr(args, "precision", None):
        return storage_dtype(precision(args.precision)).name
    return args.dtype


def add_model_arguments(parser) -> None:
    """--precision (or --dtype), --tokenizer and --backend: how a command that loads a saved model (eval, generate,
    serve) runs it (mpi_tp.checkpoint.model: load_model takes model_dtype(args), model_tokenizer the tokenizer;
    use_backend)."""
    add_format_arguments(parser, "as saved: a bf16 checkpoint or Hugging Face folder runs at bf16")
    parser.add_argument("--tokenizer", default="auto", help="what the text is as ids: 'auto' (the default: the "
                        "model's own, its folder's tokenizer.json or the one its checkpoint keeps, else bytes), "
                        "'bytes', a tokenizer.json, or a folder holding one")
    parser.add_argument("--backend", choices=["numpy", "cupy"], default="numpy",   # as train and bench have it
                        help="array backend: numpy (CPUs, the default) or cupy (one GPU per rank)")


def use_backend(args, comm) -> None:
    """args.backend on every rank, before any array is made; if a rank cannot use it (no CuPy, no GPU),
    every rank stops with one message (exit 2)."""
    collective_setup(backend.use, args.backend, comm, comm=comm)


def on_rank0(fn, comm) -> int:
    """Run fn on rank 0 only; every rank returns its status (errors become one message)."""
    status = collective_setup(lambda: fn() if comm.Get_rank() == 0 else 0, comm=comm)
    return comm.bcast(status)


def model_ids(corpus, tok, vocab_size: int, data: str, model: str) -> numpy.ndarray:
    """A corpus (mpi_tp.training.data) as the model's token ids: a text through the model's tokenizer `tok`
    (a token file's ids as they are); a DataError if an id is past the model's vocabulary."""
    if corpus.tokenizer is None and tok.kind != "bytes":          # a text: through the model's tokenizer
        corpus.data = numpy.asarray(tok.encode(corpus.data.tobytes()), dtype=numpy.int64)
        corpus.vocab_size = tok.vocab_size
    tokens, V = corpus.data, vocab_size
    # ids of a larger vocabulary than the model's (bytes into a model of fewer than 256 tokens, a token file of
    # another tokenizer): refused if any is past it (every rank sees the same data: the same answer everywhere)
    top = int(tokens.max()) if corpus.vocab_size > V else 0                   # (one pass over the data)
    if top >= V:
        raise DataError(f"{data} holds ids of a vocabulary of {corpus.vocab_size} (up to {top}); {model} has "
                        f"{V} tokens: evaluate it on data of its own tokenizer")
    return tokens
