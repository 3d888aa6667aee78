"""Memory per rank, measured: the live arrays of a training step by category, and their peak over the step.

    meter = MemoryMeter(stage, opt)             # stage: a PipelineStage, or as_stage(model) for a GPT
    with meter:                                 # sampled at every probe point while inside
        train_step(stage, opt, x, y, rows, reducer=reducer)
    meter.report()        # {"peak": {category: bytes, "total"}, "peak_at", "max": {...}, "samples", "device"}

Categories (bytes this rank keeps; views counted once, in the first category that reaches them):

    parameters     each parameter storage (Param.base; ZeRO-1: the buckets' flat parameter buffers it views;
                   ZeRO-3: the shares, and the whole buffers of the pieces gathered)
    gradients      each gradient storage (the buckets' flat gradient buffers that Param.grad views;
                   ZeRO-1's averaged share, grad_share)
    optimizer      the optimizer's state: AdamW's m and v, SGD's momentum, fp32 masters of 16-bit weights
    workspace      the optimizer's block scratch (two arrays of at most optim.BLOCK elements)
    activations    what the layers' caches keep for backward passes: the chunk's own caches and the caches
                   the pipeline stage set aside for each micro-batch in flight (PipelineStage.stashed),
                   and what a deferred W keeps until it runs (PipelineStage.deferred, core.weight_grads)
    communication  the pipeline's receive buffers posted ahead and the sends still in flight (engine)

Every array is reduced to the array owning its memory (its .base chain), and each owner is counted
once, so a parameter's gradient that is a view into a bucket, or a cache that is a view of a layer's
input, is not counted twice. This is the project's own accounting of what it allocates, not the
process's: temporaries inside one kernel (a GEMM's output before it is cached, the backward's weight
gradients before they are added) are not seen, nor is the allocator's slack (on NumPy, the RSS).
On CuPy the device's memory pool is read at the same points (`device`: the pool's used and total
bytes at their peak; cupy.get_default_memory_pool()).

Probe points (`probe(point)`, where the peak can occur): after each forward or backward action of
the pipeline engine ("F", "B"; a GPT runs as the one stage of the "none" schedule), inside a block's
backward once full recomputation has rebuilt its caches ("recompute"), in the loss's forward
with the logits and their softmax both alive ("loss", mpi_tp.model.parallel_cross_entropy), after the
gradients' reduction ("reduced", mpi_tp.training.step) and after the optimizer step ("updated"). Off (no meter
entered) a probe is one test of an empty list.
"""
from __future__ import annotations

from mpi_tp.core import backend

CATEGORIES = ("parameters", "gradients", "optimizer", "workspace", "activations", "communication")

_meters: list = []          # the meters sampling now (entered, not yet left)


def probe(point: str, in_flight=(), transient=()) -> None:
    """Sample every meter entered. in_flight: the engine's pending sends and receives (their buffers,
    communication); transient: arrays a layer holds in its frame at this point, not (yet) in a cache
    (activations: the loss's logits beside its softmax)."""
    for meter in _meters:
        meter.sample(point, in_flight, transient)


def owner(a):
    """The array that owns a's memory (a view's base, followed to its end)."""
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def arrays_in(item):
    """Every array inside a cache (nested tuples, lists and dicts of arrays and other values)."""
    if isinstance(item, (tuple, list)):
        for i in item:
            yield from arrays_in(i)
    elif isinstance(item, dict):
        for i in item.values():
            yield from arrays_in(i)
    elif hasattr(item, "nbytes") and hasattr(item, "shape"):
        yield item


def device_pool() -> dict | None:
    """{"used", "total"} bytes of CuPy's default memory pool when the backend is CuPy, else None."""
    if backend.name() != "cupy":
        return None
    try:
        import cupy
    except ImportError:                 # backend says cupy: only when it imported; kept for safety
        return None
    pool = cupy.get_default_memory_pool()
    return {"used": int(pool.used_bytes()), "total": int(pool.total_bytes())}


class MemoryMeter:
    """Samples the categories of `stage`'s memory (and `opt`'s) at the probe points while entered.

    stage: a PipelineStage (mpi_tp.parallel.pipeline.stage.as_stage(model) for a GPT); opt: its
    optimizer, or None; reducer: a GradReducer not reachable from opt (the non-distributed one,
    whose buckets hold the gradients that Param.grad views), or None.
    """

    def __init__(self, stage, opt=None, reducer=None):
        self.stage, self.opt = stage, opt
        self.reducer = reducer if reducer is not None else getattr(opt, "reducer", None)
        self.reset()

    def reset(self) -> None:
        self.peak, self.peak_at, self.samples = {k: 0 for k in (*CATEGORIES, "total")}, None, 0
        self.max = {k: 0 for k in CATEGORIES}
        self.device = {"used": 0, "total": 0} if device_pool() is not None else None

    def __enter__(self):
        _meters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _meters.remove(self)

    def _groups(self, in_flight, transient):
        """(category, arrays) in the order that decides where an array shared by two is counted."""
        params = self.stage.parameters()
        buckets = self.reducer.buckets if self.reducer is not None else []
        yield "parameters", [p.base for p in params] + [b.params for b in buckets if b.params is not None] + \
            [b.param_share for b in buckets if b.param_share is not None]     # ZeRO-3: a copy of its own
        yield "gradients", [p.grad_base for p in params if p.grad_base is not None] + \
            [b.grads for b in buckets if b.grads is not None] + [b.grad_share for b in buckets if b.grad_share is not None]
        opt = self.opt
        yield "optimizer", [a for arrays in opt.state.values() for a in arrays] if opt is not None else []
        yield "workspace", [opt._scratch, opt._scaled] if opt is not None else []
        caches = [c for chunk in self.stage.chunks for c in chunk.cached_arrays()]
        for stash in getattr(self.stage, "stashed", {}).values():
            caches += [a for _, _, cache in stash for a in arrays_in(cache)]
        for work in getattr(self.stage, "deferred", {}).values():     # zero-bubble: W's inputs, until W runs
            caches += list(work.arrays())
        yield "activations", caches + list(transient)
        yield "communication", [x for p in in_flight for x in (p.x, p.buf) if x is not None]

    def measure(self, in_flight=(), transient=()) -> dict:
        """{category: bytes} now, each owner once."""
        seen, out = set(), {}
        for category, arrays in self._groups(in_flight, transient):
            total = 0
            for a in arrays:
                a = owner(a)
                if id(a) not in seen:
                    seen.add(id(a))
                    total += int(a.nbytes)
            out[category] = total
        out["total"] = sum(out.values())
        return out

    def sample(self, point: str, in_flight=(), transient=()) -> dict:
        now = self.measure(in_flight, transient)
        self.samples += 1
        for k in CATEGORIES:
            self.max[k] = max(self.max[k], now[k])
        if now["total"] > self.peak["total"]:
            self.peak, self.peak_at = now, point
        pool = device_pool() if self.device is not None else None
        if pool is not None:
            self.device = {k: max(self.device[k], pool[k]) for k in pool}
        return now

    def report(self) -> dict:
        """The categories at the sample of the largest total (`peak`, sampled at `peak_at`), each
        category's own largest value (`max`), the number of samples, and the device pool's peak (CuPy)."""
        return {"peak": dict(self.peak), "peak_at": self.peak_at, "max": dict(self.max), "samples": self.samples,
                "device": self.device}
