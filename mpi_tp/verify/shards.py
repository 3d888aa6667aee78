"""A rank's shards against the serial model's whole tensors, by name.

Gradients are read where the optimizer reads them (training.optimizer_state: one space per storage, or,
under ZeRO-1, this rank's share of each data-parallel bucket), so what is compared is what the update
used, reduced over dp. Each space element is traced back to its parameter and its place in the whole
tensor: a storage (several fused parameters, e.g. q, k, v) sits at an offset of the space, and a
parameter is a view of its storage (Param.view) holding the slice Param.index() of the whole tensor.

An error is max |shard - serial| / scale, scale the serial tensor's largest magnitude; for a gradient,
at least a millionth of the model's largest gradient element (a tensor whose exact gradient is zero,
such as GPT-2's key bias under softmax, holds rounding noise on both sides).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core import backend

FLOOR = 1e-6            # a gradient's scale is at least this share of the model's largest gradient element
NOISE_ONLY = ("attn/k/bias",)    # exact gradient 0 (softmax cancels it): its AdamW updates are rounding noise


@dataclass
class Difference:
    """The largest difference found in one tensor on this rank."""

    name: str
    error: float                 # max |shard - serial| / scale
    where: tuple                 # the element's index in the whole tensor
    shard: str                   # which part of the whole tensor this rank holds ("[0:16, :]")

    def as_row(self) -> tuple:
        return self.name, self.error, self.where, self.shard


def shard_text(p) -> str:
    """The slice of the whole tensor that Param p holds, e.g. "[:, 16:32]" ("whole" when replicated)."""
    if p.axis is None:
        return "whole"
    return "[" + ", ".join(f"{p.start}:{p.stop}" if a == p.axis else ":" for a in range(len(p.global_shape))) + "]"


def _worst(name, got, want, scale, index_of, shard) -> Difference:
    diff = numpy.abs(numpy.asarray(got, dtype=numpy.float64) - want)
    if diff.size == 0:
        return Difference(name, 0.0, (), shard)
    k = int(diff.argmax())
    return Difference(name, float(diff.flat[k]) / scale if scale > 0 else float(diff.flat[k]), index_of(k), shard)


def gradient_differences(opt, serial: dict) -> list[Difference]:
    """Every parameter's gradient, as the optimizer on this rank reads it, against the serial gradient."""
    grads = {n: backend.asnumpy(p.grad).astype(numpy.float64) for n, p in serial.items()}
    floor = FLOOR * max((float(numpy.abs(g).max()) for g in grads.values() if g.size), default=0.0)
    worst: dict[str, Difference] = {}
    covered = 0                                 # the space elements traced back to a parameter
    for space in opt.spaces:
        g = backend.asnumpy(space.grads())
        lo, hi = space.share.start, space.share.stop
        for at, base, members in space.stores:
            a, b = max(at, lo) - at, min(at + base.size, hi) - at          # this rank's run of the storage
            if a >= b:
                continue
            flat_index = numpy.arange(base.size).reshape(base.shape)
            seen = numpy.zeros(base.size, dtype=bool)
            for p in members:
                idx = flat_index[p.view].reshape(-1)                       # p's elements, in its own order
                mine = (idx >= a) & (idx < b)
                if not mine.any():
                    continue
                seen[idx[mine]] = True
                whole = grads[p.name]
                want = whole[p.index()].reshape(-1)[mine]
                got = g[idx[mine] + at - lo]
                scale = max(float(numpy.abs(whole).max()), floor)
                positions = numpy.flatnonzero(mine)
                shard_shape = whole[p.index()].shape

                def index_of(k, p=p, positions=positions, shard_shape=shard_shape):
                    local = numpy.unravel_index(int(positions[k]), shard_shape)
                    return tuple(int(i) + (p.start if d == p.axis else 0) for d, i in enumerate(local))
                d = _worst(p.name, got, want, scale, index_of, shard_text(p))
                if p.name not in worst or d.error > worst[p.name].error:
                    worst[p.name] = d
            covered += int(seen.sum())
    total = sum(space.size for space in opt.spaces)
    if covered != total:        # verify checks itself: an element left out would pass unseen
        raise RuntimeError(f"verify traced {covered} of the {total} gradient elements this rank's update reads "
                           "back to a parameter")
    return list(worst.values())


def parameter_differences(params, serial: dict) -> list[Difference]:
    """Every parameter this rank holds against the serial one (after the same update)."""
    out = []
    for p in params:
        if p.name.endswith(NOISE_ONLY):
            continue
        whole = backend.asnumpy(serial[p.name].data).astype(numpy.float64)
        want = whole[p.index()]
        scale = float(numpy.abs(whole).max())

        def index_of(k, p=p, shape=want.shape):
            local = numpy.unravel_index(k, shape)
            return tuple(int(i) + (p.start if d == p.axis else 0) for d, i in enumerate(local))
        out.append(_worst(p.name, backend.asnumpy(p.data), want, scale, index_of, shard_text(p)))
    return out
