"""A saved model rebuilt to use: `load_model` (the model at tensor-parallel size = world size, filled from an
mpi_tp checkpoint or a Hugging Face folder) and `model_tokenizer` (the text it reads, as --tokenizer names it).

    model, ck = load_model("runs/X/checkpoints", comm)           # model.eval(), ck (closed: meta, dir, step)
    tok = model_tokenizer("auto", ck, comm)                      # ck's own tokenizer; or "bytes", a tokenizer.json

Both are collective over comm: every rank calls them, and a failure on any rank is one message on every
rank (mpi_tp.core.runtime.collective_setup). eval, generate, serve and import-hf load with them
(mpi_tp.commands).
"""
from __future__ import annotations

from mpi_tp.checkpoint.read import load_into, open_checkpoint
from mpi_tp.core.runtime import collective_setup
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology


def load_model(path: str, comm, dtype: str | None = None):
    """(model, checkpoint): the saved model rebuilt at tp = world size and filled from the checkpoint
    (an mpi_tp checkpoint, or a Hugging Face model folder: open_checkpoint)."""
    def build():
        ck = open_checkpoint(path)
        cfg = GPTConfig(**ck.meta["config"])
        model = GPT(cfg, Topology.create(comm), dtype=dtype or ck.meta.get("dtypes", "float32"))
        return model, ck
    model, ck = collective_setup(build, comm=comm)
    with ck:
        collective_setup(load_into, ck, model, comm=comm)
    return model.eval(), ck


def model_tokenizer(spec: str, ck, comm):
    """The tokenizer of --tokenizer spec ('auto': ck's own); collective (every rank loads it: one message if
    any cannot)."""
    from mpi_tp.text.tokenizer import load_tokenizer
    return collective_setup(lambda: ck.tokenizer() if spec == "auto" else load_tokenizer(spec), comm=comm)
