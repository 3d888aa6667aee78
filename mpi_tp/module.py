"""The small base class of every layer: parameter discovery and a one-shot forward cache.

A layer owns its parameter shards (`Param`), their gradients, and one cache
that each forward overwrites and its backward consumes. Backward accumulates
into `Param.grad`; zeroing is explicit (`zero_grad`). Calling backward without
a forward, or twice for one forward, is an error rather than silently wrong
gradients.
"""
from __future__ import annotations

from .params import Param


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

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.zero_grad()

    def save_cache(self, *cache) -> None:
        self._cache = cache

    def take_cache(self):
        """The cache of the last forward, which backward consumes (so a second backward fails)."""
        cache = self._cache
        if cache is None:
            raise RuntimeError(f"{type(self).__name__}.backward called without a matching forward")
        self._cache = None
        return cache
