"""Flat token files (nanoGPT's kind): the corpus tokenized once, then memory-mapped by every rank.

    write_tokens("data/train.bin", ids, tokenizer, source)   # data/train.bin + data/train.bin.json
    tokens, meta = read_tokens("data/train.bin")             # a read-only numpy.memmap, and the sidecar

FILE.bin holds the ids back to back, uint16 when the vocabulary fits (V <= 65536), else uint32, in
little-endian order; FILE.bin.json (the sidecar) says what they are: format, dtype, count, vocab_size,
the tokenizer (kind, path, sha256) and the source (name, sha256). Both are written to temporary names
and renamed into place, the sidecar last, so a file that is there was written in full; read_tokens
checks the size, the dtype and that every id is below vocab_size.
"""
from __future__ import annotations

import json
import os

import numpy

from mpi_tp.core.errors import UserError

FORMAT, VERSION = "mpi_tp tokens", 1


class TokenFileError(UserError, ValueError):
    """A token file that cannot be read or written; the message says what is wrong."""


def sidecar(path: str) -> str:
    return path + ".json"


def is_token_file(path: str) -> bool:
    return os.path.isfile(path) and os.path.isfile(sidecar(path))


def write_tokens(path: str, ids, tokenizer, source: dict, overwrite: bool = False) -> dict:
    """Write ids (any integer sequence) and their sidecar; the sidecar's content."""
    from mpi_tp.core.errors import refuse_to_replace
    refuse_to_replace(path, overwrite, "tokenize --out")
    V = tokenizer.vocab_size
    dtype = numpy.dtype("<u2") if V <= 1 << 16 else numpy.dtype("<u4")
    ids = numpy.asarray(ids, dtype=numpy.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= V):
        raise TokenFileError(f"ids outside 0..{V - 1} for a vocabulary of {V}: the tokenizer's vocab_size is wrong")
    meta = {"format": FORMAT, "version": VERSION, "dtype": dtype.str, "count": int(ids.size), "vocab_size": V,
            "tokenizer": tokenizer.describe(), "source": source}
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    for name, write in ((path, lambda f: f.write(ids.astype(dtype).tobytes())),
                        (sidecar(path), lambda f: f.write(json.dumps(meta, indent=1).encode()))):
        with open(name + ".tmp", "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name + ".tmp", name)
    return meta


def read_tokens(path: str) -> tuple[numpy.ndarray, dict]:
    """(ids as a read-only memmap, the sidecar), or TokenFileError saying what is wrong."""
    try:
        with open(sidecar(path)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise TokenFileError(f"{path}: no {sidecar(path)} beside it (write token files with mpi-tp tokenize)") from None
    except (OSError, ValueError) as e:
        raise TokenFileError(f"{sidecar(path)} cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise TokenFileError(f"{sidecar(path)} is not an {FORMAT!r} sidecar of version {VERSION}")
    try:
        dtype, count, V = numpy.dtype(meta["dtype"]), int(meta["count"]), int(meta["vocab_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise TokenFileError(f"{sidecar(path)}: a field is missing or wrong ({e})") from None
    if dtype not in (numpy.dtype("<u2"), numpy.dtype("<u4")) or count < 1 or V < 1:
        raise TokenFileError(f"{sidecar(path)}: dtype {dtype}, count {count}, vocab_size {V} cannot be")
    size = os.path.getsize(path)
    if size != count * dtype.itemsize:
        raise TokenFileError(f"{path} has {size} bytes; its sidecar says {count} ids of {dtype.itemsize} bytes "
                             f"({count * dtype.itemsize}): the file is cut or not this sidecar's")
    ids = numpy.memmap(path, dtype=dtype, mode="r", shape=(count,))
    if int(ids.max()) >= V:
        raise TokenFileError(f"{path} holds id {int(ids.max())}, not below its vocab_size {V}")
    return ids, meta
