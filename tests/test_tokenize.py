"""Tokenizers and token files (mpi_tp.text): round trips, a token file equal to tokenizing in memory,
clear errors for bad files, and training on a token file (its vocabulary, its tokenizer's sample)."""
import json
import sys

import numpy
import pytest
from jobs import MPIEXEC, run_job

from mpi_tp.core.errors import UserError
from mpi_tp.text.token_file import TokenFileError, read_tokens, write_tokens
from mpi_tp.text.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer

pytest.importorskip("tokenizers")
TEXT = ("def tokenize(text):\n    return [ord(c) for c in text]  # é, 漢字, 😀\n" * 40
        + "The quick brown fox jumps over the lazy dog. " * 60)


def mpi_tp(*args, n=None, timeout=180):
    cmd = ([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py"] if n else [sys.executable]) + ["-m", "mpi_tp", *args]
    return run_job(cmd, timeout=timeout)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE of 300 tokens trained on TEXT by `mpi-tp tokenize --train-bpe`, and its token file."""
    folder = tmp_path_factory.mktemp("bpe")
    (folder / "corpus.txt").write_text(TEXT)
    r = mpi_tp("tokenize", "--data", str(folder / "corpus.txt"), "--train-bpe", "300", "--out", str(folder / "tok"))
    assert r.returncode == 0, r.stderr
    return folder


def test_bytes_round_trip():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(TEXT)) == TEXT and max(tok.encode(TEXT)) < 256 and load_tokenizer("bytes").kind == "bytes"


def test_a_trained_bpe_round_trips_and_compresses(bpe):
    tok = load_tokenizer(str(bpe / "tok"))                     # the folder holding tokenizer.json
    for text in (TEXT, "unseen words: Zürich, ∑, \x00\t\n", ""):
        assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == 300 and len(tok.encode(TEXT)) < len(TEXT.encode()) / 1.5      # 44 merges: 1.9 bytes a token


def test_the_token_file_equals_tokenizing_in_memory(bpe, tmp_path):
    tok = load_tokenizer(str(bpe / "tok" / "tokenizer.json"))
    ids, meta = read_tokens(str(bpe / "tok" / "tokens.bin"))
    assert ids.dtype == numpy.dtype("<u2") and list(ids) == tok.encode(TEXT)
    assert meta["vocab_size"] == 300 and meta["tokenizer"]["sha256"] == tok.sha256 and meta["count"] == len(ids)
    out = tmp_path / "again.bin"                               # and with --tokenizer, through the command
    r = mpi_tp("tokenize", "--data", str(bpe / "corpus.txt"), "--tokenizer", str(bpe / "tok"), "--out", str(out))
    assert r.returncode == 0 and numpy.array_equal(read_tokens(str(out))[0], ids), r.stderr
    r = mpi_tp("tokenize", "--data", str(bpe / "corpus.txt"), "--tokenizer", "bytes", "--out", str(out))
    assert r.returncode == 2 and "exists already: pass --overwrite" in r.stderr


def test_bad_token_files_say_what_is_wrong(tmp_path):
    path = str(tmp_path / "t.bin")
    write_tokens(path, [1, 2, 3, 255], ByteTokenizer(), {"name": "x"})
    assert list(read_tokens(path)[0]) == [1, 2, 3, 255]
    with open(path, "ab") as f:
        f.write(b"\x00")
    with pytest.raises(TokenFileError, match="the file is cut or not this sidecar's"):
        read_tokens(path)
    with pytest.raises(TokenFileError, match="no .*nothing.bin.json beside it"):
        read_tokens(str(tmp_path / "nothing.bin"))
    with pytest.raises(TokenFileError, match="ids outside 0..255"):
        write_tokens(str(tmp_path / "u.bin"), [256], ByteTokenizer(), {})
    meta = json.loads((tmp_path / "t.bin.json").read_text())
    (tmp_path / "t.bin.json").write_text(json.dumps({**meta, "vocab_size": 3, "count": 4}))
    (tmp_path / "t.bin").write_bytes(numpy.array([1, 2, 3, 255], "<u2").tobytes())
    with pytest.raises(TokenFileError, match="holds id 255, not below its vocab_size 3"):
        read_tokens(path)
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        load_tokenizer(str(tmp_path / "missing"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match="is not a tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    assert issubclass(TokenFileError, UserError) and issubclass(TokenizerError, UserError)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
def test_training_on_a_token_file(bpe, tmp_path):
    """2 ranks on the BPE's token file: the model's vocabulary is the file's, the run records the tokenizer,
    the sample is the tokenizer's text."""
    r = mpi_tp("train", "--data", str(bpe / "tok" / "tokens.bin"), "--steps", "3", "--n-layer", "1", "--n-embd",
               "32", "--n-head", "2", "--block-size", "16", "--batch-size", "2", "--eval-every", "3", "--sample-len",
               "8", "--out", str(tmp_path / "run"), n=2)
    assert r.returncode == 0, r.stderr
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["model"]["vocab_size"] == 300 and run["data"]["vocab_size"] == 300
    assert run["data"]["tokenizer"]["kind"] == "tokenizer.json" and run["data"]["tokens"] > 1000
    assert "nats/token" in r.stdout and "--- sample ---" in r.stdout and "no sample" not in r.stdout, r.stdout
