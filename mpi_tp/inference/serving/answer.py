"""A request's answer in OpenAI's shapes, built as its choices' tokens come (no HTTP here: http.py sends it).

    /v1/completions        {"object": "text_completion", "choices": [{"index", "text", "logprobs", "finish_reason"}]}
    /v1/chat/completions   {"object": "chat.completion", "choices": [{"index", "message": {"role", "content"}, ...}]}
    streamed               one chunk per piece of text ("text_completion" / "chat.completion.chunk" with a delta:
                           the role first, then content), a chunk with each choice's finish_reason, the last of
                           them with the usage, then [DONE]

Choice i is prompt i // n's (i % n)-th sample. finish_reason: "length" after max_tokens tokens, "stop" at a
stop sequence or an end-of-sequence id. logprobs (completions): per generated token its text, its
log-probability, the `logprobs` likeliest tokens' (and the chosen one's, if not among them) and the text's
offset in the choice's text; chat (logprobs: true, top_logprobs: k): {"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}. A token's text is the tokenizer's decoding of it alone (bytes: a byte that is not
a whole character is "bytes:\\xNN", as OpenAI writes it).
"""
from __future__ import annotations

import time
import uuid

from mpi_tp.inference.api import Completion, TextOut


def token_text(tokenizer, token: int) -> str:
    if tokenizer.kind == "bytes":
        return chr(token) if token < 0x80 else f"bytes:\\x{token:02x}"
    return tokenizer.decode([token])


def token_bytes(tokenizer, token: int) -> list[int]:
    """A token's UTF-8 bytes (chat logprobs' "bytes")."""
    return [token] if tokenizer.kind == "bytes" else list(tokenizer.decode([token]).encode())


class Choice:
    """One choice so far: its text's pieces, tokens, log-probabilities and how it ended."""

    def __init__(self, request, prompt_text: str, echo: bool):
        self.request, self.out = request, TextOut(request.stop)
        self.pieces = [prompt_text] if echo else []
        self.ids, self.logprobs, self.reason = [], {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                   "text_offset": []}, None
        self.content = []                                     # chat's logprobs: one entry per token

    def add(self, token, tokenizer, chat: bool) -> tuple[str, dict | None]:
        """The text this token adds, and (logprobs asked) its log-probabilities in OpenAI's format (completions',
        or chat's)."""
        piece = self.out.add(token.piece)
        self.ids.append(token.id)
        self.pieces.append(piece)
        if token.logprob is None:
            return piece, None
        text = token_text(tokenizer, token.id)
        top = {token_text(tokenizer, i): lp for i, lp in token.top}
        top.setdefault(text, token.logprob)                   # the chosen token's, always (OpenAI: up to k + 1)
        self.content.append({"token": text, "logprob": token.logprob, "bytes": token_bytes(tokenizer, token.id),
                             "top_logprobs": [{"token": token_text(tokenizer, i), "logprob": v,
                                               "bytes": token_bytes(tokenizer, i)} for i, v in token.top]})
        lp = self.logprobs
        offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else 0
        new = {"tokens": [text], "token_logprobs": [token.logprob], "top_logprobs": [top], "text_offset": [offset]}
        for k, v in new.items():
            lp[k] += v
        return piece, new if not chat else {"content": self.content[-1:]}

    def finish(self) -> str:
        piece = self.out.finish()
        self.pieces.append(piece)
        self.reason = "length" if len(self.ids) >= self.request.max_tokens and not self.out.stopped else "stop"
        return piece


class Answer:
    """The answer to a Completion: feed it each (index, Token) and each choice's end; it gives the stream's
    chunks as they come and, at the end, the whole body."""

    def __init__(self, c: Completion, model: str, tokenizer):
        self.c, self.model, self.tokenizer = c, model, tokenizer
        self.id = f"{'chatcmpl' if c.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created, self.live = int(time.time()), len(c.requests)
        self.choices = [Choice(r, c.prompts[i // c.n], c.echo) for i, r in enumerate(c.requests)]

    def _chunk(self, i: int, text: str, reason: str | None = None, logprobs=None, role: bool = False, **extra) -> dict:
        if self.c.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text} if text else {}
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            kind = "chat.completion.chunk"
        else:
            choice, kind = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}, "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [{**choice, **extra}]}

    def opening(self) -> list[dict]:
        """The stream's first chunks: a chat's role, an echoed prompt."""
        if self.c.chat:
            return [self._chunk(i, "", role=True) for i in range(len(self.choices))]
        return [self._chunk(i, ch.pieces[0]) for i, ch in enumerate(self.choices) if self.c.echo]

    def add(self, i: int, token) -> dict | None:
        """Choice i's next token: the chunk to stream (None: nothing new to say yet)."""
        piece, logprobs = self.choices[i].add(token, self.tokenizer, self.c.chat)
        return self._chunk(i, piece, logprobs=logprobs) if piece or logprobs else None

    def finish(self, i: int) -> list[dict]:
        """Choice i is done: the chunks that end it (the last one's with the usage, if it was the last)."""
        ch = self.choices[i]
        piece, self.live = ch.finish(), self.live - 1
        extra = {"token_ids": ch.ids} if self.c.token_ids else {}
        chunks = [self._chunk(i, piece)] if piece else []
        chunks.append(self._chunk(i, "", ch.reason, **extra))
        if self.live == 0:
            chunks[-1]["usage"] = self.usage()
        return chunks

    @property
    def tokens(self) -> int:
        return sum(len(ch.ids) for ch in self.choices)

    def usage(self) -> dict:
        p = sum(len(r.prompt) for r in self.c.requests[::self.c.n])       # each prompt once, whatever n
        return {"prompt_tokens": p, "completion_tokens": self.tokens, "total_tokens": p + self.tokens}

    def body(self) -> dict:
        """The whole answer, once every choice is done."""
        choices = []
        for i, ch in enumerate(self.choices):
            text = "".join(ch.pieces)
            if self.c.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": ch.reason,
                          "logprobs": {"content": ch.content} if self.c.logprobs is not None else None}
            else:
                choice = {"index": i, "text": text, "logprobs": ch.logprobs if self.c.logprobs is not None else None,
                          "finish_reason": ch.reason}
            if self.c.token_ids:
                choice.update(token_ids=ch.ids, prompt_token_ids=list(ch.request.prompt))
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.c.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
