"""`mpi-tp train --arch llama` end to end under mpiexec: it learns, --pp 2 trains what --tp 2 trains (untied
lm_head on the last stage, the one key/value head replicated over tp), checkpoints hold the Llama names,
`mpi-tp generate` gives the same greedy text at 1 and 2 ranks, bad combinations are one clear message."""
import json

import h5py
import pytest
from jobs import MPIEXEC, TINY, mpirun, train_layouts  # noqa: F401  (shared launcher helpers)

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
LLAMA = ["--arch", "llama", "--n-kv-head", "1", "--intermediate-size", "40", "--rope-theta", "500",
         "--untie-embeddings"]


def test_llama_trains_and_generates(tmp_path):
    out = tmp_path / "run"
    r = mpirun(2, "train", *TINY, *LLAMA, "--n-head", "2", "--n-embd", "16", "--steps", "120", "--warmup", "10",
               "--lr", "1e-2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["final_val_loss"] < run["unigram_entropy"] - 0.1, (run["final_val_loss"], run["unigram_entropy"])
    config = json.loads((out / "config.json").read_text())
    assert config["arch"] == "llama" and config["n_kv_head"] == 1 and config["untie_embeddings"]
    with h5py.File(next((out / "checkpoints").glob("step-*")) / "index.h5", "r") as f:
        names = set(f["model"].keys()) | {f"h/0/{k}" for k in f["model/h/0"].keys()}
        assert {"wte", "lm_head", "h/0/mlp", "h/0/attn"} <= names and "wpe" not in names
        assert f["model/h/0/attn/k/weight"].shape == (16, 8) and f["model/h/0/mlp/gate/weight"].shape == (16, 40)
    args = ["generate", "--checkpoint", str(out / "checkpoints"), "--greedy", "--max-new-tokens", "20",
            "--prompt", "The ", "--prompt", "def "]
    one, two = mpirun(1, *args), mpirun(2, *args)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert one.stdout == two.stdout and len(one.stdout.splitlines()) == 2


def test_llama_pipeline_equals_tensor_parallel(tmp_path):
    """--pp 2 (1F1B) and --tp 2 (replicated key/value head, untied head): the same losses and checkpoints."""
    common = [*LLAMA, "--n-layer", "3", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--steps", "3",
              "--dtype", "float64", "--dropout", "0.1", "--log-every", "1", "--eval-every", "2",
              "--eval-batches", "1", "--sample-len", "8", "--batch-size", "2", "--micro-batches", "2"]
    runs, tensors = train_layouts(tmp_path, common, {"tp": ["--tp", "2"], "pp": ["--pp", "2"]}, step=3)
    assert abs(runs["pp"]["final_val_loss"] - runs["tp"]["final_val_loss"]) < 1e-9
    assert runs["pp"]["sample"] == runs["tp"]["sample"]
    assert tensors["pp"].keys() == tensors["tp"].keys() and "model/lm_head" in tensors["tp"]
    worst = max(float(abs(tensors["pp"][n] - tensors["tp"][n]).max()) for n in tensors["tp"])
    assert worst < 1e-12, worst


@pytest.mark.parametrize("args,message", [
    (["--n-kv-head", "2"], "--n-kv-head set with --arch gpt2"),
    (["--untie-embeddings"], "--untie-embeddings set with --arch gpt2"),
    (["--arch", "llama", "--n-kv-head", "3"], "n_kv_head = 3 must be a positive integer dividing n_head = 4"),
    (["--arch", "llama", "--n-embd", "12", "--n-head", "4"], "must be even"),
    (["--arch", "llama", "--tie-embeddings", "--untie-embeddings"], "not both"),
])
def test_llama_errors_are_one_clear_message(tmp_path, args, message):
    r = mpirun(2, "train", "--out", str(tmp_path / "o"), *args, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("mpi-tp: error:") == 1 and message in r.stderr, r.stderr
