"""What several commands share: the options of the commands that run a saved model (eval, generate, serve:
--dtype, --tokenizer, --backend) and use_backend, and `on_rank0` for the commands that one process does under
mpiexec (inspect, export, tokenize).

The model and its tokenizer come from the library (mpi_tp.checkpoint.model: load_model, model_tokenizer).
"""
from __future__ import annotations

from mpi_tp.core import backend
from mpi_tp.core.runtime import collective_setup


def add_model_arguments(parser) -> None:
    """--dtype, --tokenizer and --backend: how a command that loads a saved model (eval, generate, serve) runs it
    (mpi_tp.checkpoint.model: load_model takes the dtype, model_tokenizer the tokenizer; use_backend)."""
    parser.add_argument("--dtype", choices=["float32", "float64"], help="compute dtype (default: as saved)")
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
