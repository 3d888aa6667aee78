"""`mpi-tp serve`: a saved model behind an OpenAI-style HTTP API, tensor-parallel over every rank.

    mpiexec -n 2 mpi-tp serve --checkpoint runs/X/checkpoints --port 8000    # --backend cupy: GPUs
    curl -s localhost:8000/v1/completions -d '{"prompt": "The ", "max_tokens": 32, "temperature": 0}'

The model loads at tensor-parallel size = world size (as eval and generate do), on
--backend's arrays (numpy, or cupy: one GPU per rank); rank 0 answers HTTP and every
rank computes (mpi_tp.inference.serving).
SIGTERM, SIGUSR1 or Ctrl-C stops it cleanly: the batch in flight is finished, exit 0 (under Open MPI,
signal mpiexec with SIGUSR1: it ends the ranks itself on a SIGTERM of its own; docs/clusters.md#open-mpi).
"""
from __future__ import annotations

import argparse
import os
import re

from mpi_tp.checkpoint.model import load_model, model_tokenizer
from mpi_tp.commands.common import add_model_arguments, model_dtype, use_backend
from mpi_tp.core.runtime import collective_setup
from mpi_tp.inference.serving.server import Stop, serve


def _integer(low: int, high: int):
    def parse(value: str) -> int:
        n = int(value)
        if not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {n}")
        return n
    return parse


def _milliseconds(value: str) -> float:
    x = float(value)
    if not 0 <= x <= 60_000:
        raise argparse.ArgumentTypeError(f"must be between 0 and 60000 ms, got {value}")
    return x


def _seconds(value: str) -> float:
    x = float(value)
    if not 0.1 <= x <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600 s, got {value}")
    return x


def served_name(path: str) -> str:
    """The model's short name from its path: the folder's (or file's) name, above an mpi_tp run's
    checkpoints/ or step-N/ folders (runs/X/checkpoints/step-2 -> X)."""
    parts = [p for p in os.path.abspath(path).split(os.sep) if p]
    while len(parts) > 1 and re.fullmatch(r"checkpoints|step-[0-9]+", parts[-1]):
        parts.pop()
    return parts[-1] if parts else "model"


def chat_template(args):
    """The chat template: --chat-template's file, else the Hugging Face folder's (the checkpoint's, or the
    --tokenizer folder's), else None."""
    from mpi_tp.text.chat import folder_chat_template, special_tokens, template_file
    folders = [f for f in (args.checkpoint, args.tokenizer) if os.path.isdir(f) and
               os.path.isfile(os.path.join(f, "tokenizer_config.json"))]
    if args.chat_template:
        return template_file(args.chat_template, special_tokens(folders[0]) if folders else {})
    return next((t for t in map(folder_chat_template, folders) if t is not None), None)


def cmd_serve(args, comm) -> int:
    stop = Stop().install()          # before the (slow) load: a Ctrl-C then still ends the job cleanly
    use_backend(args, comm)          # before any array is made
    model, ck = load_model(args.checkpoint, comm, model_dtype(args))
    tokenizer = model_tokenizer(args.tokenizer, ck, comm)
    template = collective_setup(lambda: chat_template(args) if comm.Get_rank() == 0 else None, comm=comm)
    return serve(model, comm, name=args.served_model_name or served_name(args.checkpoint), host=args.host,
                 port=args.port, chat_template=template,
                 max_batch=args.max_batch, batch_wait_ms=args.batch_wait_ms, stop=stop, batching=args.batching,
                 max_queue=args.max_queue, max_connections=args.max_connections, read_timeout=args.read_timeout,
                 request_timeout=args.request_timeout,
                 tokenizer=tokenizer)


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a checkpoint over HTTP (OpenAI-style /v1/completions, /v1/chat/completions)",
                       description="Serve a saved model over HTTP at tensor-parallel size = world size: "
                                   "mpiexec -n T mpi-tp serve --checkpoint C. Rank 0 answers POST "
                                   "/v1/completions, POST /v1/chat/completions, GET /v1/models and GET /health; every rank computes. "
                                   "SIGTERM, SIGUSR1 or Ctrl-C finishes the batch in flight and exits 0 (Open "
                                   "MPI's mpiexec: send it SIGUSR1).")
    s.add_argument("--checkpoint", required=True, help="checkpoint folder, a step-N folder, or a Hugging Face "
                   "GPT-2 or Llama folder")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    s.add_argument("--port", type=_integer(0, 65535), default=8000, help="TCP port (default 8000; 0: any free port, printed)")
    s.add_argument("--max-batch", type=_integer(1, 1024), default=8,
                   help="rows generated together: the KV cache's slots (default 8)")
    s.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="'continuous': requests join the running batch at the next decode step and leave when "
                        "done; 'static': a batch runs until its longest request ends (default continuous)")
    s.add_argument("--batch-wait-ms", type=_milliseconds, default=20.0,
                   help="when idle, after a first request, wait this long for more to start with it (default 20)")
    s.add_argument("--max-queue", type=_integer(0, 1_000_000), default=64,
                   help="requests that may wait for a row; past it: 429 with Retry-After (default 64)")
    s.add_argument("--max-connections", type=_integer(1, 100_000), default=256,
                   help="connections handled at once; past it: 503 at once (default 256)")
    s.add_argument("--read-timeout", type=_seconds, default=30.0,
                   help="seconds a client has to send its whole request, headers and body (default 30)")
    s.add_argument("--request-timeout", type=float, default=0.0,
                   help="seconds a completion may take from its arrival, unless its body's timeout says: past it, "
                        "504 (streaming: the text so far, then an error event) and its row freed (default 0: none)")
    s.add_argument("--served-model-name", default=None, help="the name requests' `model` must give and GET "
                   "/v1/models lists (default: the checkpoint folder's name, above checkpoints/ and step-N/)")
    s.add_argument("--chat-template", default=None, help="a file of Jinja text rendering chat messages for "
                   "/v1/chat/completions (default: the Hugging Face folder's tokenizer_config.json chat_template; "
                   "none: chat requests are refused)")
    add_model_arguments(s)
    s.set_defaults(run=cmd_serve)
