"""Ids to text as they come: what a generation streams while it runs.

A token is not always whole text: a byte-level BPE token can hold half of a
character (its other half in the next token), and a SentencePiece tokenizer
drops the leading space of a word only at the start of a text. So a stream
decodes a short window of recent ids (those since the text last moved, with
the ids before them as context) and gives out only what the newest id added,
and only once that ends in a whole character (no U+FFFD at its end):

    ids  ...  [prefix ....... read) [read ... new]
    text of prefix..read        "the"
    text of prefix..new         "the cat"        -> gives " cat"

(the approach of Hugging Face's text-generation-inference). What it gives is
UTF-8 bytes, so that the byte-level model (ByteStream: each id is one byte,
given as it is, a split character left to the reader's incremental decoder)
and a tokenizer's stream look the same to generate and to the server.
"""
from __future__ import annotations


class ByteStream:
    """Each id is a byte (bytes, the default tokenizer)."""

    def add(self, token: int) -> bytes:
        if not 0 <= token <= 255:
            raise ValueError(f"the model chose token {token}, which is not a byte: a model of more than 256 "
                             "tokens needs its tokenizer (--tokenizer: a tokenizer.json or the model's folder)")
        return bytes((token,))

    def finish(self) -> bytes:
        return b""


class TextStream:
    """A tokenizer's ids to UTF-8 text, piece by piece (decode: ids -> str)."""

    def __init__(self, decode):
        self.decode, self.ids, self.prefix, self.read = decode, [], 0, 0
        self.before = ""                  # the text of ids[prefix:read], decoded once each time they move

    def add(self, token: int) -> bytes:
        self.ids.append(token)
        after = self.decode(self.ids[self.prefix:])
        if len(after) <= len(self.before) or after.endswith("\ufffd"):   # nothing new yet, or half a character
            return b""
        piece = after[len(self.before):]
        self._move(len(self.ids))
        return piece.encode()

    def finish(self) -> bytes:
        """What the last ids hold that was waiting for the rest of a character (as U+FFFD)."""
        after = self.decode(self.ids[self.prefix:])
        piece = after[len(self.before):] if len(after) > len(self.before) else ""
        self.prefix = self.read = len(self.ids)
        self.before = ""
        return piece.encode()

    def _move(self, end: int) -> None:
        self.prefix, self.read = self.read, end
        self.before = self.decode(self.ids[self.prefix:self.read])
