"""Tests for mpi_tp.training.data: corpora, split, batches, entropy.

Each test is independent of MPI; under mpiexec every rank runs it on its own
tmp_path. Run: .venv/bin/python -m pytest -q tests/test_data.py
"""
import hashlib
import io
import math
import os
import urllib.error
import urllib.request

import numpy as np
import pytest

from mpi_tp.training import data
from mpi_tp.training.data import BatchSampler, Corpus, DataError


def _corpus(raw: bytes) -> Corpus:
    return Corpus("test", np.frombuffer(raw, np.uint8).copy(), hashlib.sha256(raw).hexdigest(), "test")


# --- corpora ----------------------------------------------------------------

def test_pydoc_corpus_is_deterministic_and_hashed():
    a = data.load_corpus("pydoc")
    b = data.load_corpus("pydoc")
    assert a.name == "pydoc"
    assert a.data.dtype == np.uint8 and a.data.ndim == 1
    assert len(a.data) > 100_000
    assert np.array_equal(a.data, b.data) and a.sha256 == b.sha256
    assert a.sha256 == hashlib.sha256(a.data.tobytes()).hexdigest()
    from pydoc_data.topics import topics
    expected = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    assert a.data.tobytes() == expected


def test_file_corpus(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"hello, world\n")
    c = data.load_corpus(str(path))
    assert c.data.tobytes() == b"hello, world\n"
    assert c.name == "tiny.txt" and c.source == str(path)
    assert c.sha256 == hashlib.sha256(b"hello, world\n").hexdigest()


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"not found: pass --data PATH"):
        data.load_corpus(str(tmp_path / "nope.txt"))


def test_directory(tmp_path):
    with pytest.raises(DataError, match="is a directory"):
        data.load_corpus(str(tmp_path))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        data.load_corpus(str(path))


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MPI_TP_CACHE", str(tmp_path))
    assert data.default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("MPI_TP_CACHE")
    assert data.default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "mpi_tp")


# --- shakespeare: download, cache, hash check --------------------------------

def _no_network(*args, **kwargs):
    raise urllib.error.URLError("network disabled by the test")


def test_shakespeare_offline_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("MPI_TP_CACHE", str(tmp_path))
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    with pytest.raises(DataError) as err:
        data.load_corpus("shakespeare")
    msg = str(err.value)
    assert "could not download" in msg and "offline" in msg
    assert str(tmp_path / "shakespeare.txt") in msg
    assert os.listdir(tmp_path) == []   # no temporary file left behind


def test_shakespeare_wrong_hash(monkeypatch, tmp_path):
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: io.BytesIO(b"not the archive"))
    with pytest.raises(DataError, match="sha256"):
        data.load_corpus("shakespeare", cache_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []   # the bad download is deleted, nothing cached


def test_shakespeare_corrupt_cache(tmp_path):
    (tmp_path / "shakespeare.txt").write_bytes(b"truncated")
    with pytest.raises(DataError, match="delete it"):
        data.load_corpus("shakespeare", cache_dir=str(tmp_path))


@pytest.mark.slow
def test_shakespeare_download_and_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MPI_TP_CACHE", str(tmp_path))
    try:
        c = data.load_corpus("shakespeare")
    except DataError as e:
        if "could not download" in str(e):
            pytest.skip(f"no network: {e}")
        raise
    assert len(c.data) == 5_057_198
    assert c.sha256 == data.SHAKESPEARE_TEXT_SHA256
    assert c.data[:26].tobytes() == b"ALL'S WELL THAT ENDS WELL\n"   # first play by name
    assert os.path.getsize(tmp_path / "shakespeare.txt") == 5_057_198
    assert sorted(os.listdir(tmp_path)) == ["shakespeare.txt"]
    # The second load reads the cache and never touches the network.
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    again = data.load_corpus("shakespeare")
    assert np.array_equal(again.data, c.data) and again.sha256 == c.sha256


# --- split ------------------------------------------------------------------

def test_split_sizes_and_contiguity():
    raw = bytes(range(256)) * 4   # N = 1024
    train, val = data.split(_corpus(raw), val_fraction=0.25)
    assert len(train) == 768 and len(val) == 256
    assert train.tobytes() == raw[:768] and val.tobytes() == raw[768:]
    train, val = data.split(_corpus(raw))   # default 0.1: int(102.4) = 102
    assert len(val) == 102 and len(train) + len(val) == 1024
    assert np.concatenate([train, val]).tobytes() == raw


def test_split_rejects_bad_fraction():
    with pytest.raises(DataError):
        data.split(_corpus(b"abcdef"), val_fraction=1.0)


# --- batches ----------------------------------------------------------------

def _tokens(n=5000, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def test_batch_shapes_dtypes_and_targets():
    tokens = _tokens()
    B, T = 4, 16
    x, y = BatchSampler(tokens, block_size=T, batch_size=B, seed=1).batch(0)
    assert x.shape == (B, T) and y.shape == (B, T)
    assert x.dtype == np.int64 and y.dtype == np.int64
    assert x.flags.c_contiguous and y.flags.c_contiguous
    for b in range(B):
        # Find where this row starts in the token array; check x and y there.
        starts = [s for s in range(len(tokens) - T) if np.array_equal(tokens[s:s + T], x[b])]
        assert starts, "row of x is not a window of the tokens"
        s = starts[0]
        assert np.array_equal(y[b], tokens[s + 1:s + T + 1])
        assert np.array_equal(y[b, :-1], x[b, 1:])


def test_batch_is_a_function_of_seed_and_step():
    tokens = _tokens()
    a = BatchSampler(tokens, 32, 8, seed=7)
    b = BatchSampler(tokens, 32, 8, seed=7)   # e.g. another rank, or a resumed run
    for step in (0, 1, 123):
        xa, ya = a.batch(step)
        xb, yb = b.batch(step)
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    assert not np.array_equal(a.batch(0)[0], a.batch(1)[0])
    assert not np.array_equal(a.batch(0)[0], BatchSampler(tokens, 32, 8, seed=8).batch(0)[0])


def test_window_starts_cover_the_whole_range():
    # With N = T + 2 there are exactly two windows, starts 0 and 1.
    tokens = np.arange(10, dtype=np.uint8)   # N = 10, T = 8
    seen = set()
    for step in range(50):
        x, y = BatchSampler(tokens, 8, 4, seed=0).batch(step)
        seen.update(int(s) for s in x[:, 0])
        assert int(y.max()) <= 9
    assert seen == {0, 1}


def test_exactly_one_window_is_enough():
    tokens = np.arange(9, dtype=np.uint8)   # T + 1 bytes
    x, y = BatchSampler(tokens, 8, 2, seed=0).batch(0)
    assert np.array_equal(x[0], np.arange(8)) and np.array_equal(y[0], np.arange(1, 9))


def test_too_short_data_says_what_is_needed():
    with pytest.raises(DataError) as err:
        BatchSampler(np.zeros(64, np.uint8), block_size=64, batch_size=2, seed=0)
    msg = str(err.value)
    assert "64 bytes" in msg and "at least 65" in msg and "--block-size" in msg


def test_eval_batches_are_fixed():
    tokens = _tokens(2000, seed=3)
    first = data.eval_batches(tokens, 16, 4, n_batches=3, seed=0)
    second = data.eval_batches(tokens, 16, 4, n_batches=3, seed=0)
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second):
        assert x1.shape == (4, 16) and np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert not np.array_equal(first[0][0], first[1][0])
    with pytest.raises(DataError, match="validation data"):
        data.eval_batches(tokens[:10], 16, 4, n_batches=1, seed=0)


# --- entropy ----------------------------------------------------------------

def test_unigram_entropy_closed_forms():
    assert data.unigram_entropy(np.arange(256, dtype=np.uint8).repeat(3)) == pytest.approx(math.log(256))
    assert data.unigram_entropy(np.full(100, 65, np.uint8)) == 0.0
    two = np.array([0, 1] * 50, np.uint8)
    assert data.unigram_entropy(two) == pytest.approx(math.log(2))
