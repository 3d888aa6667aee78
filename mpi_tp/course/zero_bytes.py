"""The check of exercise 8: the student's formulas for ZeRO-1's traffic and optimizer memory, against real steps.

Pure data parallelism at D = world size (T = 1): one training step of a small
GPT (mpi_tp.training.step.train_step, AdamW) with the gradient reducer's
all-reduce (distributed=False), then one with the distributed optimizer's
reduce-scatter and all-gather (distributed=True, --zero 1), at three widths:
fp32; bf16 with bf16 gradients (train's --precision bf16); bf16 with fp32
gradients (--fp32-grads). Measured per rank: the wire bytes of the gradient and
parameter collectives (CommStats: dp/iall_reduce, dp/reduce_scatter,
dp/all_gather; the loss's and the norm's 8-byte all-reduces are left out) and
the bytes of the optimizer's state arrays (m, v, and fp32 masters of 16-bit
parameters), against dp_wire_bytes(num_params, D, grad_bytes, param_bytes, zero) and
state_bytes(...). A bucket's n elements are shared out as evenly as they go
(split_sizes, no padding), so one rank's state may differ from another's by an
element per bucket: the prediction is compared with their mean over the D ranks.
"""
from __future__ import annotations

import numpy
from mpi4py import MPI

from mpi_tp.core.params import storages, widen_grads
from mpi_tp.course.common import SEED, Feedback, finish, needs_ranks
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.comm_stats import wire_bytes_by_role
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import train_step

B, S, C, H, L, V = 2, 8, 16, 2, 2, 40
WIDTHS = (("fp32", "float32", False), ("bf16", "bfloat16", False), ("bf16, fp32 gradients", "bfloat16", True))
BUCKET_MB = 0.004         # a few buckets, of uneven sizes: none of them divides evenly by every D


def measure(topo: Topology, dtype: str, fp32_grads: bool, zero: bool) -> tuple[int, int, int, float, int, int]:
    """(num_params, grad bytes, param bytes, dp wire bytes of gradients and parameters, optimizer state bytes,
    buckets) of one training step on this rank."""
    model = GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=L, n_head=H, n_embd=C), topo, dtype=dtype, seed=SEED)
    params = model.parameters()
    if fp32_grads:
        widen_grads(params)
    reducer = GradReducer(model, topo.dp, bucket_mb=BUCKET_MB, distributed=zero)
    opt = AdamW(params, lr=1e-3, reducer=reducer)
    rng = numpy.random.default_rng(SEED)
    x, y = (rng.integers(0, V, (B * topo.dp.size, S)) for _ in range(2))
    topo.stats.reset()
    train_step(model, opt, x, y, topo.replica_rows(B), 1, reducer=reducer)
    roles = wire_bytes_by_role({k: {"wire_bytes": w} for k, w in topo.stats.wire.items()})
    stores = storages(params)
    num_params = sum(base.size for base, _, _ in stores)
    state = sum(a.nbytes for arrays in opt.state.values() for a in arrays)
    return (num_params, stores[0][1].dtype.itemsize, stores[0][0].dtype.itemsize, roles["dp_grads"] + roles["dp_params"],
            state, len(reducer.buckets))


def _near(a, b) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _wire_hint(fb: Feedback, guess, num_params, D, g, zero) -> None:
    ring = (D - 1) / D * num_params
    if zero and _near(guess, 2 * 2 * ring * g):
        fb.hint("ZeRO-1 does not add an all-gather to the all-reduce: it replaces the all-reduce. A ring "
                "all-reduce is a reduce-scatter then an all-gather, (D-1)/D n each; ZeRO-1 runs the two halves "
                "with the optimizer's update between them")
    elif zero and _near(guess, 2 * ring * g):
        fb.hint("the reduce-scatter carries gradients (grad_bytes a value), the all-gather the updated "
                "parameters (param_bytes a value): the two halves need not be the same size")
    elif not zero and _near(guess, ring * g):
        fb.hint("a ring all-reduce of n buffer bytes sends 2 (D-1)/D n from each rank: a reduce-scatter, then "
                "an all-gather (docs/notation.md, 'Bytes')")
    else:
        fb.hint("the buckets hold every parameter's gradient once (num_params values; their number and the way they "
                "are cut do not matter: each collective counts (D-1)/D of its buffer per ring pass)")


def _state_hint(fb: Feedback, guess, state, num_params, D, p, zero) -> None:
    whole = state * D if zero else state
    if zero and _near(guess, whole):
        fb.hint("with ZeRO-1 a rank keeps AdamW's state for its 1/D share of each bucket only: the reduce-scatter "
                "left it those gradients alone (mpi_tp/training/optimizer_state.py)")
    elif p < 4 and _near(guess * (D if zero else 1), 2 * p * num_params):
        fb.hint("16-bit parameters: the update runs on fp32 master copies, and m and v are fp32 too "
                "(mpi_tp/training/optim.py): 4 + 4 + 4 bytes a parameter, whatever the parameter's width")
    else:
        fb.hint("AdamW keeps m and v for every element it updates, in fp32 at least (and fp32 masters of "
                "16-bit parameters); the gradients and the parameters themselves are not optimizer state")


def zero_bytes(student, comm, path=None) -> bool:
    """Exercise 8: dp_wire_bytes and state_bytes of the student's file against real steps' counters and state."""
    D = comm.Get_size()
    needs_ranks(8, D, low=2)
    topo = Topology.create(comm, tp=1, dp=D)
    fb = Feedback(topo.dp.rank, path)
    for label, dtype, fp32_grads in WIDTHS:
        for zero in (False, True):
            num_params, g, p, wire, state, buckets = measure(topo, dtype, fp32_grads, zero)
            spread = (comm.allreduce(state, op=MPI.MIN), comm.allreduce(state, op=MPI.MAX))
            mean = comm.allreduce(state) / D                 # the shares differ by an element per bucket at most
            if fb.rank != 0:                                 # the wire bytes are the same on every rank
                continue
            how = "ZeRO-1" if zero else "all-reduce"
            args = (num_params, D, g, p, zero)
            where = f"{label}, {how}: num_params = {num_params}, D = {D}, grad_bytes {g}, param_bytes {p}"
            guess_w = fb.predict(student.dp_wire_bytes, "dp_wire_bytes", args)
            guess_s = fb.predict(student.state_bytes, "state_bytes", args)
            if guess_w is not None and not _near(guess_w, wire):
                fb.problems.append(f"wire bytes at {where}: you predicted {guess_w:g}, the counters measured "
                                   f"{wire:g}: off by {guess_w - wire:+g} ({guess_w / wire:.3g}x)")
                _wire_hint(fb, guess_w, num_params, D, g, zero)
            if guess_s is not None and not _near(guess_s, mean):
                fb.problems.append(f"optimizer state bytes at {where}: you predicted {guess_s:g}, the optimizer "
                                   f"keeps {mean:g} per rank (mean over the {D} ranks): off by "
                                   f"{guess_s - mean:+g} ({guess_s / mean:.3g}x)")
                _state_hint(fb, guess_s, mean, num_params, D, p, zero)
            kept = f"{spread[0]}" if spread[0] == spread[1] else f"{spread[0]} to {spread[1]} (mean {mean:g})"
            fb.facts.append(f"{where}: {wire:g} wire bytes, {kept} optimizer state bytes per rank "
                            f"({buckets} buckets)")
    topo.free()
    return finish(comm, 8, "ZeRO-1's bytes", fb, [
        ("the lesson: docs/course.md lesson 14; once you have tried, the answer: docs/parallelism.md "
         "('ZeRO-1: the distributed optimizer') and mpiexec -n 2 mpi-tp train --dp 2 --zero 1's run.json")],
        against="against the counters and the optimizer state of real steps", size="D")
