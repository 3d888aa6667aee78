"""The completions API's requests and answers, without HTTP: a JSON body to a Request, bytes to text.

`parse_completion` turns a /v1/completions body (OpenAI's field names) into a
generate.Request (the prompt through the model's tokenizer), or raises
BadRequest with what is wrong; `TextOut` turns the text a request gets, as
UTF-8 bytes token by token, into text pieces that join into exactly the whole
answer.
The server (mpi_tp.inference.serving.http) uses both; neither needs MPI.
"""
from __future__ import annotations

import codecs
import json

from mpi_tp.core.errors import UserError
from mpi_tp.inference.generate import Request


class BadRequest(Exception):
    """A request the API refuses (400), with the message that says why."""


FIELDS = {"prompt": ((str,), None, "a string: the text to continue"), "max_tokens": ((int,), 64, "an integer"),
          "temperature": ((int, float), 1.0, "a number"), "top_p": ((int, float), 1.0, "a number"),
          "top_k": ((int,), 0, "an integer"), "seed": ((int,), 0, "an integer from 0 to 2^64 - 1"),
          "stop": ((str, list), [], "a string or a list of strings"), "stream": ((bool,), False, "true or false"),
          "timeout": ((int, float), 0, "a number of seconds > 0 (0: the server's --request-timeout)")}

MAX_TOKENS = 4096        # a request's max_tokens at most
MAX_STOPS, MAX_STOP_BYTES = 4, 64     # stop sequences per request, and UTF-8 bytes per sequence (OpenAI: 4)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_completion(raw: bytes, block_size: int, vocab_size: int = 256, tokenizer=None) -> tuple[Request, bool, float]:
    """(request, stream, timeout) from a /v1/completions body, or BadRequest saying what is wrong. tokenizer:
    the prompt's (default bytes: mpi_tp.text.tokenizer); timeout: the seconds the request may take (0: the
    server's default)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)             # NaN, Infinity: refused
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object, such as {"prompt": "The ", "max_tokens": 16}')
    v = {}
    for name, (kinds, default, what) in FIELDS.items():
        x = body.get(name)                                              # null: the default
        if x is None and default is None:
            raise BadRequest(f"{name} is required ({what})")
        if x is not None and (not isinstance(x, kinds) or (isinstance(x, bool) and bool not in kinds)
                              or (name == "seed" and not 0 <= x < 2**64)):
            raise BadRequest(f"{name} must be {what}, not {json.dumps(x)[:40]}")
        v[name] = default if x is None else x
    if v["max_tokens"] > MAX_TOKENS:
        raise BadRequest(f"max_tokens must be at most {MAX_TOKENS} on this server, not {v['max_tokens']}")
    stops = [v["stop"]] if isinstance(v["stop"], str) else v["stop"]
    if len(stops) > MAX_STOPS or not all(isinstance(x, str) and x for x in stops):
        raise BadRequest(f"stop must be at most {MAX_STOPS} non-empty strings, not {json.dumps(stops)[:60]}")
    stream, timeout = v.pop("stream"), v.pop("timeout")
    if not 0 <= timeout < 1e9:
        raise BadRequest(f"timeout must be a number of seconds > 0 (0: the server's default), not {timeout}")
    try:
        stop = tuple(x.encode() for x in stops)
        if max(map(len, stop), default=0) > MAX_STOP_BYTES:
            raise BadRequest(f"a stop sequence may hold at most {MAX_STOP_BYTES} bytes (UTF-8), not "
                             f"{max(map(len, stop))}")
        prompt = v["prompt"].encode() if tokenizer is None else tuple(tokenizer.encode(v["prompt"].encode()))
        req = Request(**{**v, "prompt": prompt, "stop": stop,
                         "temperature": float(v["temperature"]), "top_p": float(v["top_p"])})
        req.check(block_size, vocab_size)
    except UnicodeEncodeError:
        raise BadRequest("the prompt and stop must be valid Unicode text (no lone surrogates)") from None
    except OverflowError:
        raise BadRequest("temperature and top_p must be numbers in their ranges") from None
    except UserError as e:
        raise BadRequest(str(e)) from None
    return req, stream, float(timeout)


class TextOut:
    """A request's text as its bytes come: UTF-8 decoded incrementally (a character split over two
    bytes waits for its second; bad bytes become U+FFFD), the stop sequence left out (bytes that may
    begin one wait), so the pieces of a stream join into exactly the text of the whole answer. Each
    byte costs at most a few comparisons per stop sequence (and the sequences are short, MAX_STOP_BYTES)."""

    def __init__(self, stop: tuple[bytes, ...] | bytes):
        stop = ((bytes(stop),) if stop else ()) if isinstance(stop, (bytes, bytearray)) else stop
        self.stop, self.out, self.sent, self.stopped = stop, bytearray(), 0, False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ends = [{b: [k + 1 for k in range(len(s) - 1) if s[k] == b] for b in set(s)} for s in stop]

    def add(self, piece: bytes) -> str:
        """The text to send after these bytes (a token's text: one byte or several)."""
        return "".join(self._add(b) for b in piece)      # (once stopped, every byte adds "")

    def _add(self, byte: int) -> str:
        if self.stopped:
            return ""
        self.out.append(byte)
        ended = [len(s) for s in self.stop if self.out.endswith(s)]
        if ended:                                          # the longest: the one that began first
            self.stopped = True
            return self._upto(len(self.out) - max(ended), final=True)
        return self._upto(len(self.out) - self._hold(byte))

    def _hold(self, byte: int) -> int:
        """The longest end of the output that begins a stop sequence (those bytes wait)."""
        hold = 0
        for s, ends in zip(self.stop, self.ends):
            for k in reversed(ends.get(byte, ())):             # s[:k] ends with this byte
                if k > hold and k <= len(self.out) and self.out.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def finish(self) -> str:
        return "" if self.stopped else self._upto(len(self.out), final=True)

    def _upto(self, end: int, final: bool = False) -> str:
        piece, self.sent = bytes(self.out[self.sent:end]), max(self.sent, end)
        return self.decoder.decode(piece, final)
