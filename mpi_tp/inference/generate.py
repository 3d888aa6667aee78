"""Batched generation: several prompts at once, each with its own sampling settings and stop condition.

    out = generate(model, [Request(b"The ", max_tokens=50, temperature=0)])   # greedy
    out[0]                                                                    # the 50 new bytes

Every rank of the tensor-parallel group calls generate with the same requests.
The decoder (mpi_tp.inference.decode) returns the last position's logits over
the whole vocabulary on every rank (the V_i shards gathered: B x V values per
step, the only gather); rank 0 chooses each row's next byte with that request's
own random stream and broadcasts the B choices, so every rank extends the same
text, a request gets the same bytes in any batch, and a fixed seed gives the
same text at every tensor-parallel size (the logits agree to rounding).

Choosing a byte: temperature 0 (or top_k 1) is greedy; otherwise the logits
are divided by the temperature, cut to the top_k likeliest (0: all) and then to
the smallest set whose probability reaches top_p (1: all), and sampled.
A request ends after max_tokens bytes or when its output ends with `stop`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core.errors import UserError
from mpi_tp.inference.decode import Decoder


@dataclass
class Request:
    prompt: bytes
    max_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: bytes = b""

    def check(self, block_size: int) -> None:
        """One UserError saying what is wrong with this request, if anything."""
        if not isinstance(self.prompt, (bytes, bytearray)) or not 1 <= len(self.prompt) <= block_size:
            raise UserError(f"the prompt must hold 1 to {block_size} bytes (the model's block_size), "
                            f"not {len(self.prompt) if isinstance(self.prompt, (bytes, bytearray)) else '?'}")
        def number(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def count(x):
            return isinstance(x, int) and not isinstance(x, bool)
        if not count(self.max_tokens) or self.max_tokens < 1:
            raise UserError(f"max_tokens must be a positive integer, not {self.max_tokens!r}")
        if not number(self.temperature) or not 0 <= self.temperature <= 100:
            raise UserError(f"temperature must be a number from 0 to 100, not {self.temperature!r}")
        if not count(self.top_k) or self.top_k < 0:
            raise UserError(f"top_k must be a non-negative integer (0: no cut), not {self.top_k!r}")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be a number in (0, 1], not {self.top_p!r}")
        if not count(self.seed) or self.seed < 0:
            raise UserError(f"seed must be a non-negative integer, not {self.seed!r}")
        if not isinstance(self.stop, (bytes, bytearray)):
            raise UserError(f"stop must be bytes, not {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def choose(logits, req: Request, rng) -> int:
    """The next byte from the whole vocabulary's logits (V,), by req's settings."""
    if req.greedy:
        return int(numpy.argmax(logits))
    z = numpy.asarray(logits, dtype=numpy.float64) / req.temperature
    if 0 < req.top_k < z.size:
        z[z < numpy.sort(z)[-req.top_k]] = -numpy.inf
    p = numpy.exp(z - z.max())
    p /= p.sum()
    if req.top_p < 1:
        order = numpy.argsort(-p, kind="stable")
        keep = numpy.searchsorted(numpy.cumsum(p[order]), req.top_p) + 1     # the smallest set reaching top_p
        cut = numpy.zeros_like(p)
        cut[order[:keep]] = p[order[:keep]]
        p = cut / cut.sum()
    return int(rng.choice(p.size, p=p))


def generate(model, requests: list[Request], on_token=None) -> list[bytes]:
    """The new bytes of each request, generated together (one batch). on_token(i, byte), if given,
    is called on every rank as request i gets each byte (a server streams from it on rank 0)."""
    if not requests:
        return []
    for r in requests:
        r.check(model.cfg.block_size)
    group = model.topo.tp
    rngs = [numpy.random.default_rng(r.seed) for r in requests]
    out = [bytearray() for _ in requests]
    live = [True] * len(requests)
    decoder = Decoder(model, len(requests))
    logits = decoder.prefill([r.prompt for r in requests])
    choice = numpy.zeros(len(requests), dtype=numpy.int64)
    for _ in range(max(r.max_tokens for r in requests)):
        if group.rank == 0:
            for i, r in enumerate(requests):
                choice[i] = choose(logits[i], r, rngs[i]) if live[i] else 0
        group.broadcast(choice)
        for i, r in enumerate(requests):
            if live[i]:
                out[i].append(int(choice[i]))
                if on_token is not None:
                    on_token(i, int(choice[i]))
                live[i] = len(out[i]) < r.max_tokens and not (r.stop and out[i].endswith(r.stop))
        if not any(live):
            break
        logits = decoder.step(choice)
    return [bytes(o) for o in out]
