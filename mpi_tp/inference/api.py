"""The completions API's requests and answers, without HTTP: a JSON body to a Request, bytes to text.

`parse_completion` and `parse_chat` turn a /v1/completions or /v1/chat/completions
body (OpenAI's field names) into a Completion: one generate.Request per choice (the
prompts through the model's tokenizer; a chat's messages through its chat template),
or raise BadRequest with what is wrong (a field this server does not know or
implement is named, not ignored); `TextOut` turns the text a request gets, as
UTF-8 bytes token by token, into text pieces that join into exactly the whole
answer.
The server (mpi_tp.inference.serving.http) uses both; neither needs MPI.
"""
from __future__ import annotations

import codecs
import json
import secrets
from dataclasses import dataclass

from mpi_tp.core.errors import UserError
from mpi_tp.inference.generate import Request


class BadRequest(Exception):
    """A request the API refuses (400, or status: 404 for a model not served), with the message that says why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


SEED = "an integer from 0 to 2^64 - 1 (none: a random one)"
FIELDS = {"max_tokens": ((int,), 64, "an integer"),
          "temperature": ((int, float), 1.0, "a number"), "top_p": ((int, float), 1.0, "a number"),
          "top_k": ((int,), 0, "an integer"), "seed": ((int,), None, SEED),
          "stop": ((str, list), [], "a string or a list of strings"), "stream": ((bool,), False, "true or false"),
          "timeout": ((int, float), 0, "a number of seconds > 0 (0: the server's --request-timeout)"),
          "n": ((int,), 1, "an integer from 1 to 16: choices per prompt"), "model": ((str,), None, "a string"),
          "user": ((str,), None, "a string"),
          "return_token_ids": ((bool,), False, "true or false (an extension: each choice's token ids)")}
COMPLETION = {"prompt": ((str, list), None, "a string, a list of strings, or token ids"),
              "echo": ((bool,), False, "true or false"),
              "logprobs": ((int,), None, "an integer from 0 to 5: the likeliest tokens given at each token")}
CHAT = {"messages": ((list,), None, 'a list of messages such as {"role": "user", "content": "Hi"}'),
        "max_completion_tokens": ((int,), None, "an integer"), "logprobs": ((bool,), False, "true or false"),
        "top_logprobs": ((int,), 0, "an integer from 0 to 5: the likeliest tokens given at each token")}
# OpenAI's fields this server does not implement: accepted only with the value that changes nothing
NEUTRAL = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "suffix": ("",),
           "best_of": (1,), "stream_options": (), "tools": ([],),
           "tool_choice": ("none",), "response_format": ({"type": "text"},), "parallel_tool_calls": ()}

MAX_TOKENS = 4096        # a request's max_tokens at most
MAX_STOPS, MAX_STOP_BYTES = 4, 64     # stop sequences per request, and UTF-8 bytes per sequence (OpenAI: 4)
MAX_N, MAX_PROMPTS, MAX_LOGPROBS = 16, 16, 5     # choices per prompt, prompts per request, top log-probabilities


@dataclass
class Completion:
    """A checked completions or chat body: one generate.Request per choice, in OpenAI's index order (prompt p's
    j-th sample is choice p * n + j; it samples with seed + j), and how to answer."""
    requests: list
    prompts: list                      # each prompt's text (echo)
    n: int = 1
    stream: bool = False
    timeout: float = 0.0               # seconds the request may take (0: the server's --request-timeout)
    echo: bool = False
    logprobs: int | None = None        # the likeliest tokens given beside each generated one (None: no logprobs)
    token_ids: bool = False            # return_token_ids: each choice's ids and its prompt's
    chat: bool = False


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _body(raw: bytes, fields: dict, example: str) -> dict:
    """The JSON object's values for `fields` (their defaults where absent or null), every other field refused
    in one message that names them."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)             # NaN, Infinity: refused
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, such as {example}")
    unknown = sorted(k for k in body if k not in fields and k not in NEUTRAL)
    unsupported = sorted(k for k in body if k not in fields and k in NEUTRAL and body[k] is not None
                         and body[k] not in NEUTRAL[k])
    if unknown or unsupported:
        said = ([f"unknown field(s) {', '.join(unknown)}"] if unknown else []) + \
               ([f"{', '.join(unsupported)} not supported by this server (leave them out)"] if unsupported else [])
        raise BadRequest("; ".join(said))
    v = {}
    for name, (kinds, default, what) in fields.items():
        x = body.get(name)                                              # null: the default
        if x is None and name in ("prompt", "messages"):
            raise BadRequest(f"{name} is required ({what})")
        if x is not None and (not isinstance(x, kinds) or (isinstance(x, bool) and bool not in kinds)
                              or (name == "seed" and not 0 <= x < 2**64)):
            raise BadRequest(f"{name} must be {what}, not {json.dumps(x)[:40]}")
        v[name] = default if x is None else x
    return v


def _prompts(x) -> list:
    """A completion's prompt field as a list of prompts, each text or a list of token ids."""
    def ids(p):
        return isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p)
    prompts = [x] if isinstance(x, str) or (ids(x) and x and isinstance(x[0], int)) else x
    if not prompts or len(prompts) > MAX_PROMPTS or not all(isinstance(p, str) or ids(p) for p in prompts):
        raise BadRequest(f"prompt must be a string, a list of 1 to {MAX_PROMPTS} strings, or token ids (a list of "
                         f"integers, or a list of such lists), not {json.dumps(x)[:60]}")
    return prompts


def _requests(v: dict, prompts: list, block_size: int, vocab_size: int, tokenizer, served: str | None,
              **how) -> Completion:
    """The Completion of checked fields v and their prompts (text, or token ids)."""
    if v["model"] is not None and served is not None and v["model"] != served:
        raise BadRequest(f"model {v['model']!r} is not served here: this server serves {served!r} "
                         "(GET /v1/models)", 404)
    if v["max_tokens"] > MAX_TOKENS:
        raise BadRequest(f"max_tokens must be at most {MAX_TOKENS} on this server, not {v['max_tokens']}")
    if not 1 <= v["n"] <= MAX_N:
        raise BadRequest(f"n must be an integer from 1 to {MAX_N}, not {v['n']}")
    stops = [v["stop"]] if isinstance(v["stop"], str) else v["stop"]
    if len(stops) > MAX_STOPS or not all(isinstance(x, str) and x for x in stops):
        raise BadRequest(f"stop must be at most {MAX_STOPS} non-empty strings, not {json.dumps(stops)[:60]}")
    if not 0 <= v["timeout"] < 1e9:
        raise BadRequest(f"timeout must be a number of seconds > 0 (0: the server's default), not {v['timeout']}")
    seed = secrets.randbits(64) if v["seed"] is None else v["seed"]     # none given: every request its own
    try:
        stop = tuple(x.encode() for x in stops)
        if max(map(len, stop), default=0) > MAX_STOP_BYTES:
            raise BadRequest(f"a stop sequence may hold at most {MAX_STOP_BYTES} bytes (UTF-8), not "
                             f"{max(map(len, stop))}")
        ids = [p if not isinstance(p, str) else p.encode() if tokenizer is None else tokenizer.encode(p.encode())
               for p in prompts]
        texts = [p if isinstance(p, str) else (tokenizer.decode(p) if tokenizer else bytes(p).decode("utf-8", "replace"))
                 if all(0 <= i < (tokenizer.vocab_size if tokenizer else 256) for i in p) else "" for p in prompts]
        reqs = [Request(prompt=tuple(p) if isinstance(p, list) else p, stop=stop, seed=(seed + j) % 2**64,
                        max_tokens=v["max_tokens"], temperature=float(v["temperature"]), top_p=float(v["top_p"]),
                        top_k=v["top_k"]) for p in ids for j in range(v["n"])]
        for r in reqs:
            r.check(block_size, vocab_size)
    except UnicodeEncodeError:
        raise BadRequest("the prompt and stop must be valid Unicode text (no lone surrogates)") from None
    except OverflowError:
        raise BadRequest("temperature and top_p must be numbers in their ranges") from None
    except UserError as e:
        raise BadRequest(str(e)) from None
    return Completion(reqs, texts, n=v["n"], stream=v["stream"], timeout=float(v["timeout"]),
                      token_ids=v["return_token_ids"], **how)


def parse_completion(raw: bytes, block_size: int, vocab_size: int = 256, tokenizer=None,
                     served: str | None = None) -> Completion:
    """A /v1/completions body (OpenAI's field names) checked in full, or BadRequest saying what is wrong.
    tokenizer: the prompt's (default bytes: mpi_tp.text.tokenizer); served: the model's name (another model
    named: 404)."""
    v = _body(raw, {**FIELDS, **COMPLETION}, '{"prompt": "The ", "max_tokens": 16}')
    if v["logprobs"] is not None and not 0 <= v["logprobs"] <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, not {v['logprobs']}")
    if v["echo"] and v["logprobs"] is not None:
        raise BadRequest("echo with logprobs (the prompt's own log-probabilities) is not supported: ask for one "
                         "or the other")
    return _requests(v, _prompts(v["prompt"]), block_size, vocab_size, tokenizer, served, echo=v["echo"],
                     logprobs=v["logprobs"])


def parse_chat(raw: bytes, block_size: int, vocab_size: int, tokenizer, template, served: str | None = None
               ) -> Completion:
    """A /v1/chat/completions body checked in full, its messages rendered by the model's chat template
    (mpi_tp.text.chat; None: the model has none, refused), or BadRequest saying what is wrong."""
    v = _body(raw, {**FIELDS, **CHAT}, '{"messages": [{"role": "user", "content": "Hi"}]}')
    if v["max_completion_tokens"] is not None:
        v["max_tokens"] = v["max_completion_tokens"]
    if not 0 <= v["top_logprobs"] <= MAX_LOGPROBS or (v["top_logprobs"] and not v["logprobs"]):
        raise BadRequest(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, with logprobs true")
    if template is None:
        raise BadRequest("this model has no chat template (its folder's tokenizer_config.json has no "
                         "chat_template): use /v1/completions, or serve it with --chat-template FILE")
    try:
        prompt = template.render(v["messages"])
    except UserError as e:
        raise BadRequest(str(e)) from None
    return _requests(v, [prompt], block_size, vocab_size, tokenizer, served, chat=True,
                     logprobs=v["top_logprobs"] if v["logprobs"] else None)


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
