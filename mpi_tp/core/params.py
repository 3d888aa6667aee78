"""Parameters as shards of full tensors, and an initialisation that is the same at every layout.

A `Param` is this rank's slice of a named full ("master") tensor: the data, its
gradient, and where the slice sits (`axis`, `start`, `stop`; axis None means
every rank holds the whole tensor). That record is all that gradient clipping,
checkpoints and tests need to know about the split.

Initialisation draws the full tensor from a random stream keyed by (seed, name)
and keeps the slice, one block of rows at a time, so memory stays bounded by a
block while tp=1 and tp=N models start from identical numbers (style.md, 5).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy

from mpi_tp.core import backend


@dataclass(eq=False)
class Param:
    """One rank's shard of the full tensor `name` (global_shape), and its gradient.

    axis: the dimension that is split across the tensor-parallel group, or None
    when the tensor is replicated; this rank holds indices [start, stop) of it.
    decay: whether AdamW applies weight decay (matrices of linear layers).
    sp_partial: under sequence parallelism, a replicated parameter that acts on each position
    (LayerNorm, row-parallel bias, position embedding) gets from each rank only the gradient of that
    rank's positions: mpi_tp.parallel.finalize sums it over the tensor-parallel group once per step
    (Megatron marks these `sequence_parallel`).
    replicas: the tensor-parallel ranks that hold this same slice (grouped-query attention's key/value
    heads when there are fewer than ranks: mpi_tp.model.heads), as a Group, or None when no other rank
    holds it. Each replica's gradient is its own query heads' part: mpi_tp.parallel.finalize sums it over
    the group once per step; the gradient norm and the checkpoint count the slice once (the group's rank 0).

    Storage: `data` is usually its own array. Several parameters can instead be
    views into one contiguous array (`base`, with `data = base[view]`), e.g.
    attention's q, k and v weights side by side so that one GEMM computes all
    three. Whatever works elementwise on whole arrays (the optimizer, the
    gradient norm) iterates over the bases (`storages`), never over views.
    """

    name: str
    data: object                 # xp array, shape = global shape with axis cut to stop - start
    global_shape: tuple
    axis: int | None = None
    start: int = 0
    stop: int = 0
    decay: bool = False
    grad: object = None          # same shape as data; backward accumulates into it
    base: object = None          # the contiguous array holding data (data itself unless fused)
    grad_base: object = None     # the same for grad
    view: tuple = ()             # data = base[view]
    fresh: bool = True           # grad still holds the zeros of zero_grad (nothing accumulated yet)
    sp_partial: bool = False     # grad is this rank's positions' part: summed over tp after the backward
    replicas: object = None      # a Group of tp ranks holding this same slice (see above), or None

    def __post_init__(self):
        if self.grad is None:
            self.grad = backend.xp().zeros_like(self.data)
        if self.base is None:
            self.base, self.grad_base = self.data, self.grad

    @property
    def sharded(self) -> bool:
        return self.axis is not None

    def index(self) -> tuple:
        """The slice of the full tensor that this shard holds."""
        idx = [slice(None)] * len(self.global_shape)
        if self.axis is not None:
            idx[self.axis] = slice(self.start, self.stop)
        return tuple(idx)

    def zero_grad(self) -> None:
        self.grad[...] = 0
        self.fresh = True

    def accumulate(self, value) -> None:
        """grad += value (what every backward does with a parameter's gradient)."""
        self.grad += value
        self.fresh = False


def accumulate_base(params: list["Param"], value) -> None:
    """grad_base += value for parameters that share one gradient base (fused parameters)."""
    params[0].grad_base += value
    for p in params:
        p.fresh = False


def fuse_last_axis(params: list[Param]):
    """Move params (same leading shape) into one array, side by side along the last axis.

    Each Param's data and grad become views of the shared base arrays, which are
    returned: (data base, grad base). fuse_last_axis([q, k, v]) gives (C, 3 C_i).
    """
    xp = backend.xp()
    base = xp.concatenate([p.data for p in params], axis=-1)
    grad_base = xp.concatenate([p.grad for p in params], axis=-1)
    at = 0
    for p in params:
        n = p.data.shape[-1]
        view = (Ellipsis, slice(at, at + n))
        p.data, p.grad, p.base, p.grad_base, p.view = base[view], grad_base[view], base, grad_base, view
        at += n
    return base, grad_base


def widen_grads(params: list[Param]) -> None:
    """Give 16-bit parameters fp32 gradients (Megatron's --accumulate-allreduce-grads-in-fp32): the
    backward's contributions are added in fp32, and the data-parallel reduction carries fp32. Each
    storage's gradient becomes one fp32 array of the same layout, its parameters' grads views of it."""
    xp = backend.xp()
    for base, grad_base, members in storages(params):
        if grad_base.dtype.itemsize < 4:
            wide = xp.zeros_like(grad_base, dtype=xp.float32)          # keeps the layout (order 'K')
            wide[...] = grad_base
            for p in members:
                p.grad_base, p.grad = wide, (wide[p.view] if p.view else wide)


def storages(params: list[Param]) -> list[tuple]:
    """The distinct contiguous arrays behind params: [(base, grad_base, [params viewing it])]."""
    out, seen = [], {}
    for p in params:
        key = id(p.base)
        if key not in seen:
            seen[key] = len(out)
            out.append((p.base, p.grad_base, []))
        out[seen[key]][2].append(p)
    for base, _, members in out:
        if len({(m.decay, m.sharded, m.sp_partial, id(m.replicas)) for m in members}) > 1:
            raise ValueError(f"params {[m.name for m in members]} share storage but differ in decay, sharding, "
                             "sp_partial or replicas")
    return out


def store_out_in(params: list[Param]) -> int:
    """Lay the linear layers' weights out (out, in), as PyTorch's nn.Linear does: each storage that is a
    matrix (decay), C-ordered and its own array becomes base = t.T with t = its transpose, C-ordered. The
    values and shapes stay; mpi_tp.core.kernels.linear_forward then makes the weight the tall operand of a
    few-row GEMM (a decoder's). Storages that are views into another array (a reducer's buckets) are left.
    An optimizer refuses such storages (mpi_tp.training.optimizer_state.flat): a model laid out for
    decoding is not trained. Returns how many storages were laid out."""
    xp, done = backend.xp(), 0
    for base, _, members in storages(params):
        if base.ndim != 2 or not members[0].decay or not (base.flags.c_contiguous and base.flags.owndata):
            continue
        base = xp.ascontiguousarray(base.T).T             # (in, out) values, stored (out, in)
        for p in members:
            p.base, p.data = base, base[p.view] if p.view else base
        done += 1
    return done


def _stream(seed: int, name: str) -> numpy.random.Generator:
    # crc32 is stable across runs and Python versions (str hash() is salted).
    return numpy.random.default_rng([seed, zlib.crc32(name.encode())])


def normal_shard(name, global_shape, std, seed, dtype, axis=None, start=0, stop=None, block_elems=1 << 20):
    """This rank's slice of a N(0, std^2) tensor whose numbers depend only on (seed, name)."""
    global_shape = tuple(global_shape)
    rng = _stream(seed, name)
    rows, row_shape = global_shape[0], global_shape[1:]
    per_row = int(numpy.prod(row_shape)) if row_shape else 1
    block = max(1, block_elems // per_row)
    stop = global_shape[axis] if (axis is not None and stop is None) else stop
    last_row = stop if axis == 0 else rows    # rows past the slice need not be drawn
    parts = []
    for r0 in range(0, last_row, block):
        r1 = min(r0 + block, rows)
        chunk = rng.standard_normal((r1 - r0,) + row_shape)  # float64 draws: same numbers for every dtype
        if axis == 0:
            lo, hi = max(r0, start), min(r1, stop)
            if lo < hi:
                parts.append(chunk[lo - r0:hi - r0])
        elif axis is None:
            parts.append(chunk)
        else:
            idx = [slice(None)] * len(global_shape)
            idx[axis] = slice(start, stop)
            parts.append(chunk[tuple(idx)])
    full = numpy.concatenate(parts, axis=0) * std
    return backend.asarray(full.astype(dtype))


@dataclass(eq=False)
class Buffer:
    """State a layer keeps beside its parameters and updates without a gradient (a mixture of experts' expert
    bias): whole on every rank that holds the layer, saved and loaded with the parameters (model/<name>), left
    out of the optimizer, the gradient reduction and the gradient norm. Checkpoints read the fields a Param has."""
    name: str
    data: object
    axis = None
    start = stop = 0
    replicas = None
    sharded = False

    @property
    def global_shape(self) -> tuple:
        return tuple(self.data.shape)


def make_param(name, global_shape, dtype, *, init="normal", std=0.02, seed=0,
               axis=None, start=0, stop=None, decay=False, sp_partial=False, replicas=None) -> Param:
    """Create the shard [start, stop) along `axis` (None: whole) of parameter `name`.

    init: "normal" (N(0, std^2), keyed by seed and name), "zeros" or "ones".
    sp_partial: see Param (only for a replicated parameter under sequence parallelism).
    replicas: see Param (only for a shard that other tensor-parallel ranks hold too).
    """
    global_shape = tuple(int(s) for s in global_shape)
    if axis is not None and stop is None:
        stop = global_shape[axis]
    local = list(global_shape)
    if axis is not None:
        local[axis] = stop - start
    xp = backend.xp()
    if init == "normal":
        data = normal_shard(name, global_shape, std, seed, dtype, axis, start, stop)
    elif init == "zeros":
        data = xp.zeros(tuple(local), dtype=dtype)
    elif init == "ones":
        data = xp.ones(tuple(local), dtype=dtype)
    else:
        raise ValueError(f"unknown init {init!r}")
    if sp_partial and axis is not None:
        raise ValueError(f"{name}: a sharded parameter's gradient is never a partial sum over positions")
    if replicas is not None and axis is None:
        raise ValueError(f"{name}: replicas are for a shard that several ranks hold, not a whole tensor")
    return Param(name, data, global_shape, axis, start, stop if axis is not None else 0, decay,
                 sp_partial=sp_partial, replicas=replicas)
