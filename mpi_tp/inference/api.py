"""The completions API's requests and answers, without HTTP: a JSON body to a Request, bytes to text.

`parse_completion` turns a /v1/completions body (OpenAI's field names) into a
generate.Request, or raises BadRequest with what is wrong; `TextOut` turns the
bytes a request gets into text pieces that join into exactly the whole answer.
The server (mpi_tp.inference.server) uses both; neither needs MPI.
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
          "top_k": ((int,), 0, "an integer"), "seed": ((int,), 0, "a non-negative integer"),
          "stop": ((str,), "", "a string (one stop sequence)"), "stream": ((bool,), False, "true or false")}


MAX_TOKENS = 4096        # a request's max_tokens at most (one request holds its whole batch until it ends)


def parse_completion(raw: bytes, block_size: int) -> tuple[Request, bool]:
    """(request, stream) from a /v1/completions body, or BadRequest saying what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object, such as {"prompt": "The ", "max_tokens": 16}')
    if isinstance(body.get("stop"), list) and len(body["stop"]) <= 1:    # the OpenAI list form, one sequence
        body["stop"] = body["stop"][0] if body["stop"] else None
    v = {}
    for name, (kinds, default, what) in FIELDS.items():
        x = body.get(name)                                              # null: the default
        if x is None and default is None:
            raise BadRequest(f"{name} is required ({what})")
        if x is not None and (not isinstance(x, kinds) or (isinstance(x, bool) and bool not in kinds)
                              or (name == "seed" and x < 0)):
            raise BadRequest(f"{name} must be {what}, not {json.dumps(x)[:40]}")
        v[name] = default if x is None else x
    if v["max_tokens"] > MAX_TOKENS:
        raise BadRequest(f"max_tokens must be at most {MAX_TOKENS} on this server, not {v['max_tokens']}")
    stream = v.pop("stream")
    try:
        req = Request(**{**v, "prompt": v["prompt"].encode(), "stop": v["stop"].encode(),
                         "temperature": float(v["temperature"]), "top_p": float(v["top_p"])})
        req.check(block_size)
    except UnicodeEncodeError:
        raise BadRequest("the prompt and stop must be valid Unicode text (no lone surrogates)") from None
    except OverflowError:
        raise BadRequest("temperature and top_p must be numbers in their ranges") from None
    except UserError as e:
        raise BadRequest(str(e)) from None
    return req, stream


class TextOut:
    """A request's text as its bytes come: UTF-8 decoded incrementally (a character split over two
    bytes waits for its second; bad bytes become U+FFFD), the stop sequence left out (bytes that may
    begin it wait), so the pieces of a stream join into exactly the text of the whole answer."""

    def __init__(self, stop: bytes):
        self.stop, self.out, self.sent, self.stopped = stop, bytearray(), 0, False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, byte: int) -> str:
        self.out.append(byte)
        s = self.stop
        if s and self.out.endswith(s):
            self.stopped = True
            return self._upto(len(self.out) - len(s), final=True)
        hold = next((k for k in range(min(len(s) - 1, len(self.out)), 0, -1) if self.out.endswith(s[:k])), 0)
        return self._upto(len(self.out) - hold)

    def finish(self) -> str:
        return "" if self.stopped else self._upto(len(self.out), final=True)

    def _upto(self, end: int, final: bool = False) -> str:
        piece, self.sent = bytes(self.out[self.sent:end]), max(self.sent, end)
        return self.decoder.decode(piece, final)
