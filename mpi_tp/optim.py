"""Optimizers (AdamW, SGD), the learning-rate schedule, and gradient clipping under tensor parallelism.

The updates are elementwise, so each rank updates its own shards with no
communication and the result is the same as the serial update of the full
tensor. Only the global gradient norm needs the group: sharded parameters
contribute their squares from every rank (all-reduce SUM), replicated ones
are counted once (every rank holds the same gradient).
"""
from __future__ import annotations

import math

from . import backend
from .comm import Group
from .params import Param


def grad_norm(params: list[Param], group: Group) -> float:
    """The L2 norm of the full model's gradient, the same on every rank."""
    xp = backend.xp()
    sharded = [float((p.grad * p.grad).sum()) for p in params if p.sharded]
    replicated = [float((p.grad * p.grad).sum()) for p in params if not p.sharded]
    buf = xp.asarray([math.fsum(sharded)], dtype="float64")
    group.all_reduce(buf)                                   # one scalar all-reduce per step
    return math.sqrt(float(buf[0]) + math.fsum(replicated))


def clip_grad_norm(params: list[Param], group: Group, max_norm: float) -> float:
    """Scale all gradients so that their global norm is at most max_norm (<= 0: no clipping).

    Returns the norm before clipping.
    """
    norm = grad_norm(params, group)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            p.grad *= scale
    return norm


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warm-up for `warmup` steps, then cosine decay to min_ratio * base_lr at `total`."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class SGD:
    """p -= lr * (grad + weight_decay * p) for decayed params; optional momentum."""

    def __init__(self, params: list[Param], lr=0.1, momentum=0.0, weight_decay=0.0):
        self.params, self.lr, self.momentum, self.weight_decay = params, lr, momentum, weight_decay
        self.buf = [backend.xp().zeros_like(p.data) for p in params] if momentum else None
        self.t = 0

    def state_tensors(self) -> dict:
        """Per-parameter state arrays by kind (saved in checkpoints as optim/<kind>/<name>)."""
        return {"momentum": self.buf} if self.buf is not None else {}

    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        self.t += 1
        for i, p in enumerate(self.params):
            g = p.grad
            if self.weight_decay and p.decay:
                g = g + self.weight_decay * p.data
            if self.buf is not None:
                self.buf[i] *= self.momentum
                self.buf[i] += g
                g = self.buf[i]
            p.data -= lr * g


class AdamW:
    """Adam with bias correction and decoupled weight decay (Loshchilov & Hutter 2019).

        m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
        p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)  +  lr * wd * p   (decay params only)
    """

    def __init__(self, params: list[Param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        xp = backend.xp()
        self.params, self.lr, self.eps, self.weight_decay = params, lr, eps, weight_decay
        self.b1, self.b2 = betas
        self.m = [xp.zeros_like(p.data) for p in params]
        self.v = [xp.zeros_like(p.data) for p in params]
        self.t = 0

    def state_tensors(self) -> dict:
        """Per-parameter state arrays by kind (saved in checkpoints as optim/<kind>/<name>)."""
        return {"m": self.m, "v": self.v}

    def step(self, lr: float | None = None) -> None:
        lr = self.lr if lr is None else lr
        self.t += 1
        c1 = 1.0 - self.b1 ** self.t
        c2 = 1.0 - self.b2 ** self.t
        step_size = lr / c1
        xp = backend.xp()
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad
            if self.weight_decay and p.decay:
                p.data *= 1.0 - lr * self.weight_decay         # decoupled: not part of the moments
            m *= self.b1
            m += (1.0 - self.b1) * g
            v *= self.b2
            v += (1.0 - self.b2) * (g * g)
            denom = xp.sqrt(v / c2)
            denom += self.eps
            p.data -= step_size * (m / denom)
