"""Batched generation: several prompts at once, each with its own sampling settings and stop condition.

    out = generate(model, [Request(b"The ", max_tokens=50, temperature=0)])   # greedy
    out[0]                                                                    # the 50 new bytes

Every rank of the tensor-parallel group calls generate with the same requests.
The decoder (mpi_tp.inference.decode) returns the last position's logits over
the whole vocabulary on every rank (the V_i shards gathered: B x V values per
step, the only gather); rank 0 chooses each row's next byte with that request's
own random stream (a `Row`) and broadcasts its choices as one command
(mpi_tp.inference.serving.protocol, the server's protocol), so every rank
extends the same text; a finished row leaves the batch at once. A request gets
the same bytes in any batch and a fixed seed the same text at every
tensor-parallel size (the logits agree to rounding).

Choosing a byte: temperature 0 (or top_k 1) is greedy; otherwise the logits,
less their maximum, are divided by the temperature (a temperature so small
that every other byte's weight underflows to 0 is greedy, not NaN), cut to the
top_k likeliest (0: all) and then to the smallest set whose probability
reaches top_p (1: all), and sampled. A request ends after max_tokens bytes or
when its output ends with one of its stop sequences. Rank 0's sampling never
raises between collectives: a request it cannot serve (logits that are not
finite) leaves the batch with its error, the others go on, and generate then
raises one UserError on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core import failpoints
from mpi_tp.core.errors import UserError
from mpi_tp.inference.decode import compaction
from mpi_tp.inference.serving.protocol import Batch, broadcast_command, wire


@dataclass
class Request:
    prompt: bytes
    max_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple = ()               # stop sequences (bytes); one bytes value is taken as one sequence

    def __post_init__(self):
        if isinstance(self.stop, (bytes, bytearray)):
            self.stop = (bytes(self.stop),) if self.stop else ()

    def check(self, block_size: int, vocab_size: int = 256) -> None:
        """One UserError saying what is wrong with this request, if anything."""
        if not isinstance(self.prompt, (bytes, bytearray)) or not 1 <= len(self.prompt) <= block_size:
            raise UserError(f"the prompt must hold 1 to {block_size} bytes (the model's block_size), "
                            f"not {len(self.prompt) if isinstance(self.prompt, (bytes, bytearray)) else '?'}")
        if max(self.prompt) >= vocab_size:        # a model of fewer than 256 tokens (an imported one)
            raise UserError(f"the prompt holds byte {max(self.prompt)}, but the model's vocabulary has "
                            f"{vocab_size} tokens (0 to {vocab_size - 1})")
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
        if not count(self.seed) or not 0 <= self.seed < 2**64:
            raise UserError(f"seed must be an integer from 0 to 2^64 - 1, not {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, bytes) and s for s in self.stop):
            raise UserError(f"stop must be non-empty byte strings, not {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def choose(logits, req: Request, rng) -> int:
    """The next byte from the whole vocabulary's logits (V,), by req's settings; ValueError if the
    logits are not finite (a model that diverged)."""
    z = numpy.array(logits, dtype=numpy.float64)
    if not numpy.isfinite(z).all():
        raise ValueError("the model's logits are not finite (NaN or infinity)")
    if req.greedy:
        return int(numpy.argmax(z))
    with numpy.errstate(over="ignore"):            # a tiny temperature sends all but the maximum to -inf
        z = (z - z.max()) / req.temperature        # <= 0, the maximum at 0: exp cannot overflow nor give NaN
    if 0 < req.top_k < z.size:
        z[z < numpy.sort(z)[-req.top_k]] = -numpy.inf
    p = numpy.exp(z)
    p /= p.sum()                                   # >= 1: the maximum's weight is exp(0)
    if req.top_p < 1:
        order = numpy.argsort(-p, kind="stable")
        keep = numpy.searchsorted(numpy.cumsum(p[order]), req.top_p) + 1     # the smallest set reaching top_p
        cut = numpy.zeros_like(p)
        cut[order[:keep]] = p[order[:keep]]
        p = cut / cut.sum()
    return int(rng.choice(p.size, p=p))


class Row:
    """Rank 0: one request being generated: its random stream, its bytes so far, and how it ended."""

    def __init__(self, ident, request: Request):
        self.id, self.request, self.rng = ident, request, numpy.random.default_rng(request.seed)
        self.out, self.error = bytearray(), None

    def take(self, logits) -> int:
        """Choose, keep and return the next byte; -1 (and self.error set) if that failed."""
        try:
            failpoints.sample_error(self.request.seed, len(self.out))
            byte = choose(logits, self.request, self.rng)
            if byte > 255:            # a model of more than 256 tokens (an imported GPT-2): no tokenizer yet
                raise ValueError(f"the model chose token {byte}, which is not a byte: text through a "
                                 f"vocabulary of {len(logits)} tokens needs a tokenizer, not supported yet")
        except Exception as e:  # noqa: BLE001 (rank 0 alone: the failure is this request's, not the job's)
            self.error = f"{type(e).__name__}: {e}"
            return -1
        self.out.append(byte)
        return byte

    @property
    def stopped(self) -> bool:
        return any(self.out.endswith(s) for s in self.request.stop)

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.out) >= self.request.max_tokens or self.stopped


def step_command(rows: list[Row], logits, joins=()) -> dict:
    """Rank 0: each running row's next byte from its logits, the rows now done, the joining requests."""
    chosen = [-1 if row.done else row.take(logits[i]) for i, row in enumerate(rows)]   # done: cancelled
    return {"cmd": "step", "bytes": chosen, "leave": [i for i, row in enumerate(rows) if row.done],
            "join": [[row.id, wire(row.request.prompt)] for row in joins],
            "errors": {str(row.id): row.error for row in rows if row.error is not None}}


def generate(model, requests: list[Request], on_token=None) -> list[bytes]:
    """The new bytes of each request, generated together. on_token(i, byte), if given, is called on
    every rank as request i gets each byte (a server streams from it on rank 0)."""
    if not requests:
        return []
    for r in requests:
        r.check(model.cfg.block_size, model.cfg.vocab_size)
    comm, root = model.topo.tp.comm, model.topo.tp.rank == 0
    batch, out, errors = Batch(model, len(requests)), [bytearray() for _ in requests], {}

    def got(i, byte):
        out[i].append(byte)
        if on_token is not None:
            on_token(i, byte)
    rows, joins, logits = [], [Row(i, r) for i, r in enumerate(requests)], None
    while joins or batch.rows:
        cmd = step_command(rows, logits, joins) if root else None
        cmd = broadcast_command(comm, cmd)
        errors.update(cmd["errors"])
        logits = batch.apply(cmd, on_byte=got)
        if root:
            rows = [rows[i] for i in compaction(len(rows), cmd["leave"])] + joins     # as the batch's rows
        joins = []
    if errors:
        raise UserError("; ".join(f"prompt {int(i) + 1}: {m}" for i, m in sorted(errors.items())))
    return [bytes(o) for o in out]
