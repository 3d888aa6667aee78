"""Tokenizers: bytes (the default: every byte a token, V = 256, nothing to install), or a Hugging Face
tokenizer.json read by the `tokenizers` library (the format's own; pip install tokenizers).

    tok = load_tokenizer("bytes")                     # or a tokenizer.json, or a folder holding one
    ids = tok.encode("The cat")                       # list of ints < tok.vocab_size
    tok.decode(ids) == "The cat"                      # for text the tokenizer can represent

`describe()` names the tokenizer for a token file's sidecar and a run's record (kind, file, sha256,
vocab size), so that what trained on a token file can be checked against what reads it.
"""
from __future__ import annotations

import hashlib
import os

from mpi_tp.core.errors import UserError


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be loaded or used; the message says what to do."""


class ByteTokenizer:
    """Every byte of the UTF-8 text is a token: V = 256, decode(encode(s)) == s for every string."""
    vocab_size, kind = 256, "bytes"

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": "bytes", "vocab_size": 256}


class HFTokenizer:
    """A tokenizer.json (byte-level BPE, WordPiece, Unigram: whatever the `tokenizers` library reads)."""
    kind = "tokenizer.json"

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(f"{path} needs the 'tokenizers' library: pip install tokenizers") from None
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 (the library raises its own Exception for any bad file)
            raise TokenizerError(f"{path} is not a tokenizer.json the tokenizers library reads ({e})") from None
        with open(path, "rb") as f:
            self.sha256 = hashlib.sha256(f.read()).hexdigest()
        self.path, self.vocab_size = os.path.abspath(path), self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {"kind": "tokenizer.json", "path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size}


def load_tokenizer(spec: str | None):
    """'bytes' (or None), a tokenizer.json, or a folder holding one (a Hugging Face model's folder)."""
    if spec in (None, "", "bytes"):
        return ByteTokenizer()
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise TokenizerError(f"no tokenizer at {spec!r}: give 'bytes', a tokenizer.json, or a folder holding one")
    return HFTokenizer(path)
