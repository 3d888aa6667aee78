"""The Hugging Face commands over mpiexec: import-hf, eval / generate / train --init-from reading a folder,
and a checkpoint trained at tp 2 x dp 2 then exported (`export --format hf`) that transformers loads with
mpi_tp's loss (GPT-2 within 1e-9; Llama within 1e-9 with transformers' two float32 steps in float64:
test_hf.float64_llama). Folders and the oracle are test_hf's."""
import json
import os

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors not installed (pip install -e '.[hf]')")
from jobs import mpirun  # noqa: E402
from test_hf import (  # noqa: E402
    LLAMA,
    TOL,
    float64_llama,
    loaded,
    needs_mpiexec,
    needs_oracle,
    numpy_folder,
)

from mpi_tp.parallel.topology import Topology  # noqa: E402


def text_below(tmp_path, vocab=97, n=3000):
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(32 + (i * 7919) % (vocab - 32) for i in range(n)))
    return str(path)


@needs_mpiexec
def test_import_hf_eval_generate_and_init_from(tmp_path):
    folder, out, text = str(tmp_path / "gpt2"), str(tmp_path / "imported"), text_below(tmp_path)
    numpy_folder(folder)
    r = mpirun(3, "import-hf", folder, out)
    assert r.returncode == 0 and "step-00000000" in r.stdout, r.stderr
    evals = []
    for n, source in ((1, folder), (2, out)):
        r = mpirun(n, "eval", "--checkpoint", source, "--data", text, "--json")
        assert r.returncode == 0, r.stderr
        evals.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert abs(evals[0]["loss"] - evals[1]["loss"]) < 1e-12 and evals[0]["dtype"] == "float64"
    r = mpirun(2, "eval", "--checkpoint", folder, "--data", "pydoc")           # bytes past the vocabulary
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1 and "97 tokens" in r.stderr
    r = mpirun(2, "generate", "--checkpoint", out, "--prompt", "AB", "--greedy", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    r = mpirun(2, "train", "--init-from", folder, "--data", text, "--steps", "2", "--batch-size", "2",
               "--eval-batches", "1", "--dtype", "float64", "--out", str(tmp_path / "run"))
    assert r.returncode == 0 and "continuing from" in r.stdout, r.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: saved[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")} == \
        dict(vocab_size=97, block_size=32, n_layer=2, n_head=5, n_embd=20)
    r = mpirun(1, "import-hf", str(tmp_path), str(tmp_path / "x"))             # not a model folder
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not a Hugging Face model folder" in r.stderr
    numpy_folder(str(tmp_path / "bad"), config={"activation_function": "relu"})
    r = mpirun(2, "eval", "--checkpoint", str(tmp_path / "bad"), "--data", text)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "activation_function 'relu'" in r.stderr


TRAINED = {"gpt2": (["--n-head", "3"], "GPT2LMHeadModel", TOL),
           "llama": (["--arch", "llama", "--n-head", "4", "--n-kv-head", "1"], "LlamaForCausalLM", TOL)}


@needs_mpiexec
def test_train_init_from_a_llama_folder(tmp_path):
    """The folder's model becomes the run's (arch, grouped-query heads, width, rope, eps, untied head)."""
    folder = str(tmp_path / "llama")
    numpy_folder(folder, LLAMA)
    r = mpirun(2, "train", "--init-from", folder, "--data", text_below(tmp_path), "--steps", "1", "--batch-size", "2",
               "--eval-batches", "1", "--dtype", "float64", "--out", str(tmp_path / "run"))
    assert r.returncode == 0 and "continuing from" in r.stdout and "no sample" in r.stdout, r.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: saved[k] for k in ("arch", "n_kv_head", "intermediate_size", "rope_theta", "norm_eps",
                                  "untie_embeddings")} == dict(arch="llama", n_kv_head=3, intermediate_size=40,
                                                               rope_theta=500.0, norm_eps=1e-6, untie_embeddings=True)
    r = mpirun(1, "train", "--init-from", folder, "--n-kv-head", "2", "--data", text_below(tmp_path), "--steps",
               "1", "--out", str(tmp_path / "run2"))
    assert r.returncode == 2 and "n_kv_head: checkpoint 3 vs model 2" in r.stderr, r.stderr


@needs_oracle
@needs_mpiexec
@pytest.mark.parametrize("arch", list(TRAINED))
def test_trained_tp2_dp2_exported_loads_in_transformers(tmp_path, arch):
    """Llama: one key/value head, a replica on each tensor-parallel rank (written once)."""
    import torch
    from transformers import AutoModelForCausalLM
    options, kind, tol = TRAINED[arch]
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    r = mpirun(4, "train", "--tp", "2", "--dp", "2", "--dtype", "float64", "--steps", "3", "--n-layer", "2",
               *options, "--n-embd", "24", "--block-size", "16", "--batch-size", "2", "--eval-batches", "1",
               "--sample-len", "0", "--out", run)
    assert r.returncode == 0, r.stderr
    root = os.path.join(run, "checkpoints")
    r = mpirun(1, "export", root, out, "--format", "hf")
    assert r.returncode == 0 and "model.safetensors" in r.stdout and kind in r.stdout, r.stderr
    r = mpirun(1, "export", root, out, "--format", "hf")
    assert r.returncode == 2 and "exists already: pass --overwrite" in r.stderr
    assert mpirun(1, "export", root, out, "--format", "hf", "--overwrite").returncode == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.float64 and type(hf).__name__ == kind
    x = np.random.default_rng(0).integers(0, 256, (4, 16))
    with torch.no_grad(), float64_llama():
        out = hf(torch.tensor(x), labels=torch.tensor(x))                      # mean over the targets x[:, 1:]
        logits = out.logits[:, :-1]                                            # float64
        theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), torch.tensor(x[:, 1:]).reshape(-1))
    ours = loaded(root, Topology.serial()).forward(x[:, :-1], x[:, 1:])
    assert abs(theirs.item() - ours) <= tol * abs(ours), (theirs.item(), ours)
    # transformers' own loss takes the logits to float32 first (ForCausalLMLoss): equal to float32's rounding
    assert abs(out.loss.item() - ours) <= 1e-6 * abs(ours), (out.loss.item(), ours)


NEW_KINDS = {"llama3-rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
             "qwen2": dict(qkv_bias=True, tie_word_embeddings=True),
             "mistral": dict(sliding_window=8)}


@needs_mpiexec
@pytest.mark.parametrize("kind", list(NEW_KINDS))
def test_fine_tune_today_s_folders(tmp_path, kind):
    """train --init-from a Llama 3 (rope scaling), Qwen2 (q/k/v biases, tied) or Mistral (sliding window) folder
    at tp 2: the folder's model is the run's, and the run's checkpoint exports back to the folder's architecture."""
    import dataclasses
    cfg = dataclasses.replace(LLAMA, **NEW_KINDS[kind])
    folder, run = str(tmp_path / kind), str(tmp_path / "run")
    numpy_folder(folder, cfg)
    r = mpirun(2, "train", "--init-from", folder, "--tp", "2", "--data", text_below(tmp_path), "--steps", "2",
               "--batch-size", "2", "--eval-batches", "1", "--dtype", "float64", "--sample-len", "0", "--out", run)
    assert r.returncode == 0 and "continuing from" in r.stdout, r.stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    want = {"rope_scaling": json.dumps(cfg.rope_scaling) if cfg.rope_scaling else "", "qkv_bias": cfg.qkv_bias,
            "sliding_window": cfg.sliding_window or 0}
    assert {k: saved[k] for k in want} == want
    root = os.path.join(run, "checkpoints")
    r = mpirun(1, "export", root, str(tmp_path / "back"), "--format", "hf")
    assert r.returncode == 0, r.stderr
    original = json.loads((tmp_path / kind / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == original["architectures"] and back.get("sliding_window") == \
        original.get("sliding_window")
