"""Dynamic loss scaling for fp16 training: the gradients lifted above fp16's underflow, and kept below its overflow.

    scaler = LossScaler(initial=2**16, window=1000, backoff=0.5, floor=1.0)
    loss = forward_backward(..., loss_scale=scaler.scale)     # every gradient is scale x the true one
    norm = grad_norm(model, opt)                              # of the scaled gradients
    problem = scaler.check(norm, topo.world)                 # one collective: every rank decides alike
    if problem is None: opt.step(lr, grad_scale=clip / scaler.scale)   # unscaled inside the update, in fp32

fp16 keeps 10 bits of fraction but only 5 of exponent: its smallest normal number is 2^-14 (6.1e-5)
and its largest 65504. A late-training gradient of 1e-7 is subnormal or zero there. Multiplying the
loss by S before the backward multiplies every gradient by S (the backward is linear in its seed), so
the same values sit log2(S) binades higher; the optimizer divides by S again in fp32 (Micikevicius
et al. 2018). With S a power of two both multiplications are exact, so a step that neither
underflows nor overflows gives the same update at any S.

The scale is found as the run goes (PyTorch's GradScaler, Megatron's DynamicGradScaler): start high;
a step whose scaled gradients hold an inf or a NaN anywhere (on any rank: one all-reduce of a flag
over the world) is skipped on every rank and the scale is multiplied by `backoff`; after `window`
good steps in a row it is doubled. A scale already at `floor` that still overflows is not an
overflow but a divergence: the step reports it as a non-finite gradient (--on-nonfinite decides).
bf16 has fp32's exponent range and needs none of this. The state (scale, good steps, overflows) is
saved in each checkpoint's metadata, so a resumed run scales as the straight one.
"""
from __future__ import annotations

import math

import numpy
from mpi4py import MPI

from mpi_tp.parallel.collectives import Group

GROWTH = 2.0            # the factor after `window` good steps (PyTorch and Megatron both double)


class Overflow(str):
    """What a step skipped for an fp16 overflow reports: expected while the scale is being found, so the
    training loop logs it and goes on (any other problem is --on-nonfinite's)."""


class LossScaler:
    """The loss scale of an fp16 run and the rule that moves it; the same on every rank."""

    def __init__(self, initial: float = 2.0 ** 16, window: int = 1000, backoff: float = 0.5, floor: float = 1.0):
        problems = [what for bad, what in [
            (not floor > 0, f"the floor must be > 0 (not {floor})"),
            (not initial >= floor, f"the initial scale {initial} is below the floor {floor}"),
            (not 0 < backoff < 1, f"the backoff must be between 0 and 1 (not {backoff})"),
            (window < 0, f"the growth window must be >= 0 steps (not {window}; 0: the scale never grows)")] if bad]
        if problems:
            raise ValueError("; ".join(problems))
        self.scale, self.window, self.backoff, self.floor = float(initial), int(window), float(backoff), float(floor)
        self.good = 0           # good steps since the last overflow or growth
        self.overflows = 0      # steps skipped for an overflow, in the whole run

    def check(self, scaled_norm: float, world: MPI.Comm, stats=None) -> str | None:
        """Collective over `world`: None when no rank's scaled gradient norm is inf or NaN (a good step,
        counted); else what happened, the same on every rank: an Overflow (skip the step; the scale has
        backed off) or, at the floor, a plain message (a divergence: the caller's --on-nonfinite).
        stats: the run's CommStats, which count the flag's all-reduce as "world/loss_scale_flag" (a Group's
        collective, counted as every other; on one rank nothing is communicated or counted)."""
        flag = numpy.array([0 if math.isfinite(scaled_norm) else 1], dtype=numpy.int32)
        Group(world, "world", stats).all_reduce(flag, op=MPI.MAX, kind="loss_scale_flag")
        if not flag[0]:
            self.good += 1
            if self.window and self.good >= self.window:
                self.scale *= GROWTH
                self.good = 0
            return None
        if self.scale <= self.floor:
            return f"the gradient overflowed fp16 at the loss-scale floor {self.floor:g}"
        was, self.scale = self.scale, max(self.scale * self.backoff, self.floor)
        self.good = 0
        self.overflows += 1
        return Overflow(f"gradient overflow at loss scale {was:g}; scale now {self.scale:g}")

    def state(self) -> dict:
        """What a checkpoint keeps (its metadata's "loss_scale")."""
        return {"scale": self.scale, "good_steps": self.good, "overflows": self.overflows, "window": self.window,
                "backoff": self.backoff, "floor": self.floor}

    def restore(self, saved: dict) -> None:
        """Continue from state(): the scale and the count of good steps (the rule is this run's own)."""
        self.scale, self.good, self.overflows = float(saved["scale"]), int(saved["good_steps"]), int(saved["overflows"])
