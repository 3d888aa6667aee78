"""Tokenizers: bytes (the default: every byte a token, V = 256, nothing to install), or a Hugging Face
tokenizer.json read by the `tokenizers` library (the format's own; pip install tokenizers).

    tok = load_tokenizer("bytes")                     # or a tokenizer.json, or a folder holding one
    ids = tok.encode("The cat")                       # list of ints < tok.vocab_size
    tok.decode(ids) == "The cat"                      # for text the tokenizer can represent
    tok.stream()                                      # ids to text as they come (mpi_tp.text.stream)

A tokenizer loaded from a model's folder also knows the ids that end a generation (`eos_ids`: the
folder's generation_config.json or config.json eos_token_id). `describe()` names the tokenizer for a
token file's sidecar, a run's record and a checkpoint (kind, file, sha256, vocab size, eos ids), so that
what trained on a token file can be checked against what reads it; a checkpoint keeps the tokenizer.json
itself (mpi_tp.checkpoint: `tokenizer_json`), so that it serves and exports without the original file.
"""
from __future__ import annotations

import hashlib
import json
import os

from mpi_tp.core.errors import UserError
from mpi_tp.text.stream import ByteStream, TextStream


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be loaded or used; the message says what to do."""


class ByteTokenizer:
    """Every byte of the UTF-8 text is a token: V = 256, decode(encode(s)) == s for every string."""
    vocab_size, kind, eos_ids, json_text = 256, "bytes", (), None

    def encode(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def stream(self) -> ByteStream:
        return ByteStream()

    def describe(self) -> dict:
        return {"kind": "bytes", "vocab_size": 256}


class HFTokenizer:
    """A tokenizer.json (byte-level BPE, WordPiece, Unigram: whatever the `tokenizers` library reads),
    from its file (path) or its text (json_text: a checkpoint's copy; source names where it came from)."""
    kind = "tokenizer.json"

    def __init__(self, path: str | None = None, json_text: str | None = None, eos_ids=(), source: str = ""):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(f"{path or source} needs the 'tokenizers' library: pip install tokenizers") from None
        source = os.path.abspath(path) if path is not None else source
        try:
            if json_text is None:
                with open(path, encoding="utf-8", newline="") as f:      # as it is: sha256 of the file
                    json_text = f.read()
            self.tok = Tokenizer.from_str(json_text)
        except Exception as e:  # noqa: BLE001 (the library raises its own Exception for any bad file)
            raise TokenizerError(f"{source} is not a tokenizer.json the tokenizers library reads ({e})") from None
        self.json_text, self.path, self.eos_ids = json_text, source, tuple(int(i) for i in eos_ids)
        self.sha256 = hashlib.sha256(json_text.encode()).hexdigest()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def stream(self) -> TextStream:
        return TextStream(self.decode)

    def describe(self) -> dict:
        return {"kind": "tokenizer.json", "path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eos_ids": list(self.eos_ids)}


def folder_eos_ids(folder: str) -> tuple[int, ...]:
    """The ids that end a generation, as a Hugging Face folder says (generation_config.json first)."""
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            return tuple(ids)
    return ()


def load_tokenizer(spec: str | None, eos_ids=None):
    """'bytes' (or None), a tokenizer.json, or a folder holding one (a Hugging Face model's folder: its
    eos ids too). eos_ids, if given, replaces what the folder says."""
    if spec in (None, "", "bytes"):
        return ByteTokenizer()
    folder = os.path.isdir(spec)
    path = os.path.join(spec, "tokenizer.json") if folder else spec
    if not os.path.isfile(path):
        raise TokenizerError(f"no tokenizer at {spec!r}: give 'bytes', a tokenizer.json, or a folder holding one")
    return HFTokenizer(path, eos_ids=eos_ids if eos_ids is not None else folder_eos_ids(spec) if folder else ())


def of_token_file(record: dict | None) -> tuple[object, str]:
    """(tokenizer, "") for a token file's sidecar record (bytes if None), or (None, why it cannot be had):
    its tokenizer.json gone, unreadable, or changed since the data was tokenized (its sha256)."""
    if record is None or record.get("kind") == "bytes":
        return ByteTokenizer(), ""
    try:
        tok = load_tokenizer(record.get("path"), eos_ids=record.get("eos_ids", ()))
    except TokenizerError as e:
        return None, f"the token file's tokenizer cannot be loaded: {e}"
    if tok.sha256 != record.get("sha256"):
        return None, f"{record.get('path')} changed since the data was tokenized"
    return tok, ""


def from_record(record: dict | None, json_text: str | None, source: str):
    """The tokenizer a checkpoint or a token file describes: bytes, or the tokenizer.json text it keeps."""
    if not record or record.get("kind") == "bytes":
        return ByteTokenizer()
    if json_text is None:
        raise TokenizerError(f"{source} names a tokenizer but does not hold it: pass --tokenizer")
    return HFTokenizer(json_text=json_text, eos_ids=record.get("eos_ids", ()), source=source)
