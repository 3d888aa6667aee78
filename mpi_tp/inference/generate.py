"""Batched generation: several prompts at once, each with its own sampling settings and stop condition.

    out = generate(model, [Request(b"The ", max_tokens=50, temperature=0)])   # greedy
    out[0]                                                                    # the new text, UTF-8
    generate(model, [Request(tok.encode("The"), 50)], tokenizer=tok)          # a tokenizer's ids

Every rank of the tensor-parallel group calls generate with the same requests.
The decoder (mpi_tp.inference.decode) returns the last position's logits over
the whole vocabulary on every rank (the V_i shards gathered: B x V values per
step, the only gather); rank 0 chooses each row's next token with that
request's own random stream (a `Row`) and broadcasts its choices as one command
(mpi_tp.inference.serving.protocol, the server's protocol), so every rank
extends the same sequence; a finished row leaves the batch at once. A request
gets the same tokens in any batch and a fixed seed the same text at every
tensor-parallel size (the logits agree to rounding).

Choosing a token: temperature 0 (or top_k 1) is greedy; otherwise the logits,
less their maximum, are divided by the temperature (a temperature so small
that every other token's weight underflows to 0 is greedy, not NaN), cut to the
top_k likeliest (0: all) and then to the smallest set whose probability
reaches top_p (1: all), and sampled. The tokens become text on rank 0 as they
come (the tokenizer's stream: mpi_tp.text.stream; bytes by default). A request
ends after max_tokens tokens, at one of the tokenizer's end-of-sequence ids
(left out of the text), or when its text holds one of its stop sequences (the
text then ends with it). Rank 0's sampling never raises between collectives: a
request it cannot serve (logits that are not finite, a token the tokenizer has
no text for) leaves the batch with its error, the others go on, and generate
then raises one UserError on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from mpi_tp.core import failpoints
from mpi_tp.core.errors import UserError
from mpi_tp.inference.decode import compaction
from mpi_tp.inference.serving.protocol import Batch, broadcast_command
from mpi_tp.text.tokenizer import ByteTokenizer


@dataclass
class Request:
    prompt: bytes | tuple            # token ids (bytes: the byte-level model's ids)
    max_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple = ()               # stop sequences (bytes); one bytes value is taken as one sequence

    def __post_init__(self):
        if isinstance(self.stop, (bytes, bytearray)):
            self.stop = (bytes(self.stop),) if self.stop else ()
        if isinstance(self.prompt, list):
            self.prompt = tuple(self.prompt)

    def check(self, block_size: int, vocab_size: int = 256) -> None:
        """One UserError saying what is wrong with this request, if anything."""
        ids = isinstance(self.prompt, (bytes, bytearray)) or (isinstance(self.prompt, tuple) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.prompt))
        if not ids or not 1 <= len(self.prompt) <= block_size:
            raise UserError(f"the prompt must hold 1 to {block_size} tokens (the model's block_size), "
                            f"not {len(self.prompt) if ids else 'something other than token ids'}")
        if max(self.prompt) >= vocab_size:        # bytes into a model of fewer than 256 tokens, another tokenizer
            raise UserError(f"the prompt holds token {max(self.prompt)}, but the model's vocabulary has "
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
    """The next token from the whole vocabulary's logits (V,), by req's settings; ValueError if the
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
    """Rank 0: one request being generated: its random stream, its tokens and text so far, how it ended."""

    def __init__(self, ident, request: Request, tokenizer=None):
        tokenizer = tokenizer or ByteTokenizer()
        self.id, self.request, self.rng = ident, request, numpy.random.default_rng(request.seed)
        self.eos, self.text = frozenset(tokenizer.eos_ids), tokenizer.stream()
        self.tokens, self.out, self.piece, self.error = 0, bytearray(), b"", None
        self.ended = False                 # an end-of-sequence id or a stop sequence

    def take(self, logits) -> int:
        """Choose and return the next token; its text (self.piece) joins self.out. -1 (and self.error
        set) if that failed."""
        try:
            failpoints.sample_error(self.request.seed, self.tokens)
            token = choose(logits, self.request, self.rng)
            self.tokens += 1
            self.ended = token in self.eos
            piece = b"" if self.ended else self.text.add(token)
            if self.done and not self.ended:
                piece += self.text.finish()          # (what waited for the rest of a character)
        except Exception as e:  # noqa: BLE001 (rank 0 alone: the failure is this request's, not the job's)
            self.error, self.piece = f"{type(e).__name__}: {e}", b""
            return -1
        self.piece = self._cut(piece)
        return token

    def _cut(self, piece: bytes) -> bytes:
        """piece, cut after the first stop sequence it completes (self.ended then)."""
        start = len(self.out)
        self.out += piece                                  # in place: no copy of the text so far per token
        ends = [self.out.find(s, max(0, start - len(s) + 1)) for s in self.request.stop]
        ends = [i + len(s) for i, s in zip(ends, self.request.stop) if i >= 0]
        if ends:
            self.ended = True
            del self.out[min(ends):]
        return bytes(self.out[start:])

    @property
    def done(self) -> bool:
        return self.error is not None or self.ended or self.tokens >= self.request.max_tokens


def step_command(rows: list[Row], logits, joins=()) -> dict:
    """Rank 0: each running row's next token from its logits, the rows now done, the joining requests."""
    chosen = [-1 if row.done else row.take(logits[i]) for i, row in enumerate(rows)]   # done: cancelled
    return {"cmd": "step", "tokens": chosen, "leave": [i for i, row in enumerate(rows) if row.done],
            "join": [[row.id, list(row.request.prompt)] for row in joins],
            "errors": {str(row.id): row.error for row in rows if row.error is not None}}


def generate(model, requests: list[Request], on_token=None, tokenizer=None) -> list[bytes]:
    """The new text (UTF-8) of each request, generated together; tokenizer: what the ids are (default:
    bytes). on_token(i, token), if given, is called on every rank as request i gets each token."""
    if not requests:
        return []
    for r in requests:
        r.check(model.cfg.block_size, model.cfg.vocab_size)
    comm, root = model.topo.tp.comm, model.topo.tp.rank == 0
    batch, errors = Batch(model, len(requests)), {}
    made = [Row(i, r, tokenizer) for i, r in enumerate(requests)]
    rows, joins, logits = [], list(made), None
    while joins or batch.rows:
        cmd = step_command(rows, logits, joins) if root else None
        cmd = broadcast_command(comm, cmd)
        errors.update(cmd["errors"])
        logits = batch.apply(cmd, on_token=on_token)
        if root:
            rows = [rows[i] for i in compaction(len(rows), cmd["leave"])] + joins     # as the batch's rows
        joins = []
    if errors:
        raise UserError("; ".join(f"prompt {int(i) + 1}: {m}" for i, m in sorted(errors.items())))
    texts = broadcast_command(comm, {"texts": [row.out.decode("latin-1") for row in made]} if root else None)
    return [t.encode("latin-1") for t in texts["texts"]]       # (latin-1: every byte through JSON as it is)
