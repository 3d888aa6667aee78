"""A saved model rebuilt to use: `load_model` (the model at tensor-parallel size = world size, filled from an
mpi_tp checkpoint or a Hugging Face folder) and `model_tokenizer` (the text it reads, as --tokenizer names it).

    model, ck = load_model("runs/X/checkpoints", comm)           # model.eval(), ck (closed: meta, dir, step)
    model, ck = load_model("gpt2-bf16-folder", comm, "float32")  # in another format: widened exactly here
    tok = model_tokenizer("auto", ck, comm)                      # ck's own tokenizer; or "bytes", a tokenizer.json

Both are collective over comm: every rank calls them, and a failure on any rank is one message on every
rank (mpi_tp.core.runtime.collective_setup). eval, generate, serve and import-hf load with them
(mpi_tp.commands).

The format (eval, generate and serve's --precision): by default the one the checkpoint was saved in (its
meta "dtypes": a bf16 training run's checkpoint, or a Hugging Face folder of BF16 tensors, loads as bf16).
Another one is reached on load: widening is exact; narrowing (float64 or fp32 to bf16 or fp16) rounds each
value once to the nearest (ties to even: ml_dtypes and NumPy convert from float64 directly, not through fp32,
so there is no second rounding). Narrowing is fine for inference, which reads only the weights; a value past
fp16's largest (65504) is refused rather than made inf. 16-bit models run on NumPy only for now (CuPy has
no bfloat16 dtype, and fp16 there is untested); a mixture of experts' router computes in fp32 at 16 bits
(mpi_tp.model.moe).
"""
from __future__ import annotations

import numpy

from mpi_tp.checkpoint.format import CheckpointError
from mpi_tp.checkpoint.read import load_into, open_checkpoint
from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.core.precision import dtype_of, is_half, precision_of
from mpi_tp.core.runtime import collective_setup
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology


def check_format(dtype, cfg: GPTConfig, path: str) -> None:
    """One UserError if the model of `cfg` cannot run in `dtype` here."""
    if not is_half(dtype):
        return
    name = precision_of(dtype).name
    if backend.xp() is not numpy:
        raise UserError(f"{path} at {name}: --backend cupy runs fp32 and float64 models for now (CuPy has no "
                        "bfloat16 dtype; fp16 there is not yet tested): pass --precision fp32 (exact from 16 bits)")


def load_model(path: str, comm, dtype: str | None = None, ep: int = 1):
    """(model, checkpoint): the saved model rebuilt at tp = world size and filled from the checkpoint
    (an mpi_tp checkpoint, or a Hugging Face model folder: open_checkpoint), in `dtype` ('float32',
    'bfloat16', ...; None: as saved). ep > 1 (a mixture of experts): the experts divided among ep groups of
    the tp ranks, each expert split over world / ep of them (etp; mpi_tp.parallel.expert_grid)."""
    def build():
        ck = open_checkpoint(path)
        try:
            cfg = GPTConfig(**ck.meta["config"])
            want = dtype_of(dtype or ck.meta.get("dtypes", "float32"))
            check_format(want, cfg, path)
            n = comm.Get_size()
            if ep > 1 and (not cfg.moe_experts or n % ep):
                raise UserError(f"--ep {ep}: needs a mixture-of-experts model and a world size it divides "
                                f"(here {n} ranks, moe_experts = {cfg.moe_experts})")
            topo = Topology.create(comm, ep=ep, etp=n // ep) if ep > 1 else Topology.create(comm)
            return GPT(cfg, topo, dtype=want), ck
        except BaseException:
            ck.close()
            raise
    model, ck = collective_setup(build, comm=comm)
    with ck:
        collective_setup(_fill, ck, model, comm=comm)
    return model.eval(), ck


def _fill(ck, model) -> None:
    """load_into, each value converted once to the model's dtype; fp16's overflow refused by name."""
    with numpy.errstate(over="ignore"):                 # a value past fp16's largest becomes inf: refused below
        load_into(ck, model)
    if model.dtype == numpy.float16:
        xp = backend.xp()
        for p in model.parameters():
            if not bool(xp.isfinite(p.data).all()):
                raise CheckpointError(f"{ck.dir}: {p.name} holds a value that fp16 cannot hold (past its largest, "
                                      "65504): load it at --precision bf16 (fp32's range) or fp32")


def model_tokenizer(spec: str, ck, comm):
    """The tokenizer of --tokenizer spec ('auto': ck's own); collective (every rank loads it: one message if
    any cannot)."""
    from mpi_tp.text.tokenizer import load_tokenizer
    return collective_setup(lambda: ck.tokenizer() if spec == "auto" else load_tokenizer(spec), comm=comm)
