"""Text through a Hugging Face folder's tokenizer.json: generate, serve, eval and train read and write text
with it, a checkpoint keeps it (import, training) and an export gives it back.

Against transformers (rank 0 the oracle, every size of the pass): greedy generation from a GPT-2 and a
grouped-query Llama folder gives transformers' own `generate(do_sample=False)` tokens, ending at the same
end-of-sequence id, and the text is the tokenizer's decoding of them. Without the oracle (folders written
with safetensors alone): the commands over mpiexec give the serial model's text, the server's answers
(whole and streamed) too, and the tokenizer survives import, training and export byte for byte. The
tokenizer is a byte-level BPE of 300 tokens trained here (mpi_tp.text.bpe), so some tokens hold half a
character: the streams must wait for the rest.
"""
import json
import os
import random
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
pytest.importorskip("tokenizers", reason="tokenizers not installed (pip install tokenizers)")
from jobs import mpirun  # noqa: E402
from serving import Server  # noqa: E402
from test_hf import (  # noqa: E402,F401
    CFG,
    LLAMA,
    loaded,
    needs_mpiexec,
    needs_oracle,
    numpy_folder,
    shared_dir,
    transformers_folder,
)

from mpi_tp.checkpoint import open_checkpoint  # noqa: E402
from mpi_tp.core.testing import from_rank0  # noqa: E402
from mpi_tp.inference.api import TextOut  # noqa: E402
from mpi_tp.inference.generate import Request, Row, generate  # noqa: E402
from mpi_tp.inference.sampling import printable  # noqa: E402
from mpi_tp.parallel.topology import Topology  # noqa: E402
from mpi_tp.text.bpe import train_bpe  # noqa: E402
from mpi_tp.text.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402

V = 300
TEXT = ("Tensor parallelism splits each weight matrix: the first linear layer by columns, the second by rows, "
        "so one all-reduce joins them. Café, naïve, 東京, 😀 and € take several bytes each. ") * 20
PROMPTS = ["The cat", "def f(x):\n", "東京 é"]


def bpe(path):
    train_bpe(TEXT, V, path)
    return load_tokenizer(path)


def text_folder(path, cfg, eos=None):
    """A folder of cfg's model (safetensors alone, vocabulary V) with the BPE's tokenizer.json and an eos id."""
    numpy_folder(path, replace(cfg, vocab_size=V), config={"eos_token_id": eos})
    bpe(os.path.join(path, "tokenizer.json"))
    return path


# ---------------------------------------------------------------- the streams, without a model

def test_a_stream_joins_into_the_decoded_text(tmp_path):
    tok = bpe(str(tmp_path / "tokenizer.json"))
    rng = random.Random(0)
    ids = tok.encode(TEXT[:400])
    assert len(ids) < len(TEXT[:400].encode()) and tok.decode(ids) == TEXT[:400]
    for _ in range(100):                 # any ids: a random run of the text's, or of the vocabulary
        run = ids[rng.randrange(len(ids)):][:rng.randint(1, 30)] if rng.random() < 0.5 else \
            [rng.randrange(V - 1) for _ in range(rng.randint(1, 30))]
        stream = tok.stream()
        pieces = [stream.add(i) for i in run] + [stream.finish()]
        assert b"".join(pieces) == tok.decode(run).encode(), run
        assert all("\ufffd" not in p.decode() for p in pieces[:-1] if p) or "\ufffd" in tok.decode(run)
    half = tok.encode("€")                                  # three bytes: not one token of this BPE
    stream = tok.stream()
    assert len(half) > 1 and [stream.add(i) for i in half][:-1] == [b""] * (len(half) - 1)
    with pytest.raises(ValueError, match="token 300, which is not a byte"):
        ByteTokenizer().stream().add(300)


def test_a_row_stops_inside_a_tokens_text(tmp_path):
    """A stop sequence that ends inside a token's text: the text ends with it, the rest is dropped, and
    the server's TextOut (given the same pieces) sends what comes before it."""
    tok = bpe(str(tmp_path / "tokenizer.json"))
    ids = tok.encode("splits each weight")
    row, out = Row(0, Request((1,), 50, temperature=0, stop=(b"ts ea",)), tok), TextOut((b"ts ea",))
    sent = []
    for i in ids:
        logits = np.zeros(V)
        logits[i] = 1.0
        row.take(logits)
        sent.append(out.add(row.piece))
        if row.done:
            break
    assert bytes(row.out) == b"splits ea" and row.ended and "".join(sent) + out.finish() == "spli"


# ---------------------------------------------------------------- against transformers

def eos_folder(folder, arch, prompts):
    """Rank 0: a transformers folder (vocabulary V) with the BPE, and transformers' greedy ids for each
    prompt, its eos a token that one prompt's free run meets after a few tokens of its own."""
    import torch
    model = transformers_folder(folder, seed=5, arch=arch, vocab_size=V)
    tok = bpe(os.path.join(folder, "tokenizer.json"))

    def greedy(eos):
        out = []
        for text in prompts:
            p = torch.tensor([tok.encode(text)])
            ids = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=10, do_sample=False,
                                 pad_token_id=0, eos_token_id=eos)[0, p.shape[1]:].tolist()
            out.append(ids[:ids.index(eos) + 1] if eos in ids else ids)      # (then padding, after eos)
        return out
    free = greedy(None)
    eos = next((run[k] for run in free for k in range(2, len(run)) if run[k] not in run[:k]), free[0][0])
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "eos_token_id": eos}, f)
    return eos, greedy(eos)


@needs_oracle
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cfg", [CFG, replace(LLAMA, n_kv_head=2)], ids=["gpt2", "llama-gqa"])
def test_greedy_text_equals_transformers(world, shared_dir, cfg):  # noqa: F811 (the fixture)
    folder = os.path.join(shared_dir, cfg.arch)
    eos, ref = from_rank0(lambda: eos_folder(folder, cfg.arch, PROMPTS), world)   # transformers: rank 0
    model = loaded(folder, Topology.create(world))
    with open_checkpoint(folder) as ck:
        tok = ck.tokenizer()
    assert tok.eos_ids == (eos,) and tok.vocab_size == V
    got = [[] for _ in PROMPTS]
    texts = generate(model, [Request(tok.encode(p), 10, temperature=0) for p in PROMPTS],
                     on_token=lambda i, t: got[i].append(t), tokenizer=tok)
    assert got == ref and any(r[-1] == eos and len(r) < 10 for r in ref)     # one ends at its eos
    assert [t.decode() for t in texts] == [tok.decode([i for i in r if i != eos]) for r in ref]


# ---------------------------------------------------------------- the commands, over mpiexec

def serial_text(folder, prompt, n, stop=()):
    from mpi4py import MPI

    from mpi_tp.checkpoint.model import load_model
    model, ck = load_model(folder, MPI.COMM_SELF, "float64")
    tok = ck.tokenizer()
    return tok, generate(model, [Request(tok.encode(prompt), n, temperature=0, stop=stop)], tokenizer=tok)[0]


@needs_mpiexec
def test_generate_and_serve_a_folder_with_its_tokenizer(tmp_path):
    folder = text_folder(str(tmp_path / "llama"), LLAMA, eos=V - 1)
    tok, want = serial_text(folder, "The cat", 12)
    r = mpirun(2, "generate", "--checkpoint", folder, "--prompt", "The cat", "--greedy", "--max-new-tokens", "12",
               "--dtype", "float64")
    assert r.returncode == 0 and r.stdout == printable(b"The cat" + want) + "\n", r.stderr
    r = mpirun(2, "generate", "--checkpoint", folder, "--tokenizer", "bytes", "--prompt", "é", "--greedy")
    assert r.returncode == 2 and "not a byte" in r.stderr and "--tokenizer" in r.stderr, r.stderr
    stop_at = want.decode("utf-8", "replace")[3:6].encode()           # inside the answer: the text ends there
    s = Server(folder, tmp_path, "--max-batch", "2")
    try:
        status, got = s.call("/v1/completions", {"prompt": "The cat", "max_tokens": 12, "temperature": 0})
        assert status == 200 and got["choices"][0]["text"] == want.decode("utf-8", "replace"), got
        assert got["usage"]["prompt_tokens"] == len(tok.encode("The cat")) < len("The cat")
        assert got["usage"]["completion_tokens"] == 12 and s.call("/health")[1]["tokenizer"] == "tokenizer.json"
        events = list(s.stream({"prompt": "The cat", "max_tokens": 12, "temperature": 0, "stop": stop_at.decode()}))
        streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
        assert streamed == want[:want.index(stop_at)].decode("utf-8", "replace") and events[-2]["choices"][0][
            "finish_reason"] == "stop", events
        status, got = s.call("/v1/completions", {"prompt": "x" * 200, "max_tokens": 2})         # 200 tokens > 32
        assert status == 400 and "1 to 32 tokens" in got["error"]["message"]
    finally:
        assert s.stop() == 0


@needs_mpiexec
def test_the_tokenizer_through_import_eval_train_and_export(tmp_path):
    folder = text_folder(str(tmp_path / "gpt2"), CFG, eos=V - 1)
    data, tokens = tmp_path / "text.txt", str(tmp_path / "tokens.bin")
    data.write_text(TEXT)
    imported = str(tmp_path / "imported")
    assert mpirun(3, "import-hf", folder, imported).returncode == 0
    r = mpirun(1, "tokenize", "--data", str(data), "--tokenizer", folder, "--out", tokens)
    assert r.returncode == 0, r.stderr
    evals = []
    for n, source, d in ((2, folder, str(data)), (2, imported, str(data)), (1, folder, tokens)):
        r = mpirun(n, "eval", "--checkpoint", source, "--data", d, "--json")
        assert r.returncode == 0, r.stderr
        evals.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert len({e["tokens"] for e in evals}) == 1 and evals[0]["tokenizer"] == evals[1]["tokenizer"] == "tokenizer.json"
    assert max(e["loss"] for e in evals) - min(e["loss"] for e in evals) < 1e-9     # the text through the BPE
    run = str(tmp_path / "run")
    r = mpirun(2, "train", "--init-from", imported, "--data", tokens, "--steps", "2", "--batch-size", "2",
               "--eval-batches", "1", "--dtype", "float64", "--sample-len", "8", "--out", run)
    assert r.returncode == 0 and "no sample" not in r.stdout, r.stdout + r.stderr
    for source in (imported, os.path.join(run, "checkpoints")):
        r = mpirun(2, "generate", "--checkpoint", source, "--prompt", "Café", "--greedy", "--max-new-tokens", "3")
        assert r.returncode == 0 and r.stdout.startswith("Café"), r.stderr
        out = str(tmp_path / f"hf-{os.path.basename(source)}")
        assert mpirun(1, "export", source, out, "--format", "hf").returncode == 0
        with open(os.path.join(out, "tokenizer.json"), "rb") as a, open(os.path.join(folder, "tokenizer.json"),
                                                                        "rb") as b:
            assert a.read() == b.read()
        with open(os.path.join(out, "config.json")) as f:
            assert json.load(f)["eos_token_id"] == V - 1
