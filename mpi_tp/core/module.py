"""The small base class of every layer: parameter discovery and a one-shot forward cache.

A layer owns its parameter shards (`Param`), their gradients, and one cache
that each forward overwrites and its backward consumes. Backward accumulates
into `Param.grad`; zeroing is explicit (`zero_grad`). Calling backward without
a forward, or twice for one forward, is an error rather than silently wrong
gradients.
"""
from __future__ import annotations

from mpi_tp.core.params import Buffer, Param


class Module:
    _cache = None

    def parameters(self) -> list[Param]:
        """Every Param of this module and its children, in definition order."""
        out, seen = [], set()
        for value in vars(self).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                found = [item] if isinstance(item, Param) else item.parameters() if isinstance(item, Module) else []
                for p in found:
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
        return out

    def buffers(self) -> list[Buffer]:
        """Every Buffer (state without a gradient) of this module and the modules below it."""
        return [v for m in self.modules() for v in vars(m).values() if isinstance(v, Buffer)]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def modules(self, _seen=None):
        """This module and every module below it, depth first, each once (the tied table wte is both the
        embedding's and the head's)."""
        seen = set() if _seen is None else _seen
        if id(self) in seen:
            return
        seen.add(id(self))
        yield self
        for value in vars(self).values():
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, Module):
                    yield from item.modules(seen)

    def stash_caches(self) -> list:
        """Take every forward cache out of this module and its children (a pipeline stage keeps one
        set per micro-batch in flight); `restore_caches` puts them back before that backward."""
        out = []
        for m in self.modules():
            for key in ("_cache", "_logits_cache"):
                if key in vars(m):
                    out.append((m, key, vars(m)[key]))
                    setattr(m, key, None)
        return out

    @staticmethod
    def restore_caches(stash: list) -> None:
        for m, key, cache in stash:
            setattr(m, key, cache)

    def save_cache(self, *cache) -> None:
        self._cache = cache

    def cached_arrays(self):
        """Every array this module and its children keep for their backward (after a forward)."""
        def walk(item):
            if isinstance(item, (tuple, list)):
                for i in item:
                    yield from walk(i)
            elif hasattr(item, "nbytes") and hasattr(item, "shape"):
                yield item
        for m in self.modules():
            for key in ("_cache", "_logits_cache"):
                yield from walk(vars(m).get(key))

    def activation_bytes(self) -> int:
        """Bytes of activation memory the caches keep alive for the backward pass (a view keeps its
        whole base alive; the parameters themselves, and the buffers they are views into, are not
        activations)."""
        def root(a):
            while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
                a = a.base
            return a
        seen, total = {id(root(x)) for p in self.parameters() for x in (p.base, p.data)}, 0
        for a in self.cached_arrays():
            a = root(a)
            if id(a) not in seen:
                seen.add(id(a))
                total += a.nbytes
        return total

    def take_cache(self):
        """The cache of the last forward, which backward consumes (so a second backward fails)."""
        cache = self._cache
        if cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a matching forward")
        self._cache = None
        return cache
