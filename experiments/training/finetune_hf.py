"""The README's walkthrough run as written: fine-tune a Hugging Face Llama folder on 4 ranks, serve it, export
it back; and the memory per rank, measured there and worked out for published models.

    python experiments/training/finetune_hf.py                  # ~3 min on 2 cores; needs safetensors and tokenizers

This machine has no route to the Hugging Face Hub, so the folder is a stand-in of the same make: a
LlamaForCausalLM folder (config.json as transformers writes it, model.safetensors, tokenizer.json, and
generation_config.json's eos id) of a small model (C 256, 4 blocks, 8 query heads over 2 key/value
heads, SwiGLU 688, untied head, 256 positions) with random weights and a byte-level BPE of 2048
tokens trained on the pydoc corpus. A downloaded folder goes through the same commands. The script
runs the README's commands (its section "Fine-tune a Hugging Face model") with the folder's path put
in, checks what each says, and checks the export: `eval` of the exported folder equals `eval` of the
checkpoint it came from, and (when transformers is installed) transformers loads it.

Memory: the model state per rank (weights, gradients, AdamW's two moments, float32; --zero 1 divides
the moments by D) is P_split / T + P_replicated per rank, times 4 + 4 + 8 (/ D) bytes. P_split holds
the matrices split over T (q, o, gate/up, down and the vocabulary tables; k and v too when there are
at least T key/value heads, else one head's replica per rank); P_replicated the norms. The formula is
checked against what the run holds (run.json's memory_mib: each rank's arrays, counted), then worked
out for published configurations (their config.json values). Activations come on top (they depend on
B and S, not on the model alone: docs/parallelism.md). Results: experiments/training/results/finetune_hf.json.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import numpy

from mpi_tp.core.runtime import machine_text

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "finetune_hf.json")
WORK = "/tmp/mpi_tp_finetune_hf"

# The README's commands (section "Fine-tune a Hugging Face model"), FOLDER for the model's folder.
README_COMMANDS = [
    "mpi-tp tokenize --data pydoc --tokenizer FOLDER --out data/pydoc.bin",
    "mpiexec -n 4 mpi-tp train --init-from FOLDER --data data/pydoc.bin --tp 2 --dp 2 --zero 1 --steps 60 "
    "--batch-size 4 --lr 3e-4 --warmup 10 --out runs/ft",
    "mpiexec -n 4 mpi-tp serve --checkpoint runs/ft/checkpoints --port 8000",
    "mpi-tp export runs/ft/checkpoints ft-hf --format hf",
]

# Published configurations (their config.json): C, layers, heads, kv heads, F, V, positions, tied.
PUBLISHED = {
    "GPT-2 (124M)": dict(arch="gpt2", C=768, L=12, H=12, KV=12, F=3072, V=50257, S=1024, tied=True),
    "SmolLM2-135M": dict(arch="llama", C=576, L=30, H=9, KV=3, F=1536, V=49152, S=8192, tied=True),
    "TinyLlama-1.1B": dict(arch="llama", C=2048, L=22, H=32, KV=4, F=5632, V=32000, S=2048, tied=False),
    "Llama-3.2-1B": dict(arch="llama", C=2048, L=16, H=32, KV=8, F=8192, V=128256, S=131072, tied=True),
    "Llama-2-7B": dict(arch="llama", C=4096, L=32, H=32, KV=32, F=11008, V=32000, S=4096, tied=False),
}
STAND_IN = dict(arch="llama", C=256, L=4, H=8, KV=2, F=688, V=2048, S=256, tied=False)


def params_per_rank(m: dict, T: int) -> tuple[float, float]:
    """(split, replicated) parameters on the largest rank at tensor-parallel size T (even splits)."""
    C, F, V, D = m["C"], m["F"], m["V"], m["C"] // m["H"]
    heads = math.ceil(m["H"] / T)
    if m["arch"] == "gpt2":                   # qkv + proj + fc + fc2, column biases split, 6 C of norms and row biases
        split = m["L"] * (4 * C * C + 2 * C * F + 3 * C + F) / T + math.ceil(V / T) * C
        return split, m["L"] * 6 * C + m["S"] * C + 2 * C
    kv = math.ceil(m["KV"] / T) if m["KV"] >= T else 1        # fewer than T: one head's replica per rank
    per_layer = 2 * C * heads * D + 2 * C * kv * D + 3 * C * math.ceil(F / T)
    tables = (1 if m["tied"] else 2) * math.ceil(V / T) * C
    return m["L"] * per_layer + tables, m["L"] * 2 * C + C


def state_mib(m: dict, T: int, D: int, zero: bool) -> float:
    split, replicated = params_per_rank(m, T)
    return (split + replicated) * (8 + 8 / (D if zero else 1)) / 2**20


def stand_in_folder(folder: str) -> None:
    from safetensors.numpy import save_file

    from mpi_tp.checkpoint.hf.config import hf_config
    from mpi_tp.checkpoint.hf.names import hf_shapes
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.text.bpe import train_bpe
    from mpi_tp.training.data import load_corpus
    os.makedirs(folder)
    text = load_corpus("pydoc").data.tobytes().decode()
    train_bpe(text, STAND_IN["V"], os.path.join(folder, "tokenizer.json"))
    m = STAND_IN
    cfg = GPTConfig(vocab_size=m["V"], block_size=m["S"], n_layer=m["L"], n_head=m["H"], n_embd=m["C"], arch="llama",
                    n_kv_head=m["KV"], intermediate_size=m["F"], tie_word_embeddings=m["tied"])
    rng = numpy.random.default_rng(0)
    tensors = {k: (0.02 * rng.standard_normal(s)).astype(numpy.float32) for k, s in hf_shapes(cfg).items()}
    for k in tensors:
        if k.endswith("norm.weight"):
            tensors[k] = numpy.ones_like(tensors[k])
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(cfg, "float32"), f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 0}, f)                # the BPE's <|endoftext|>


def run(command: str, folder: str, **kw) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    r = subprocess.run(command.replace("FOLDER", folder), shell=True, cwd=WORK, capture_output=True, text=True,
                       timeout=900, **kw)
    print(f"$ {command.replace('FOLDER', folder)}   [{time.perf_counter() - t0:.1f} s, exit {r.returncode}]",
          flush=True)
    if r.returncode != 0:
        sys.exit(f"failed:\n{r.stdout}\n{r.stderr}")
    return r


def serve_and_ask(command: str, folder: str) -> dict:
    proc = subprocess.Popen(command.replace("FOLDER", folder).replace("8000", "0"), shell=True, cwd=WORK,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        port = int(re.search(r":(\d+) \(tp=4\)", line).group(1))
        print(f"$ {command}   [{line.strip()}]", flush=True)
        body = json.dumps({"prompt": "The tuple", "max_tokens": 24, "temperature": 0}).encode()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/completions", body, timeout=120) as r:
            return json.loads(r.read())
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    folder = os.path.join(WORK, "SmolLlama-stand-in")
    stand_in_folder(folder)
    out = {"machine": machine_text(), "command": "python experiments/training/finetune_hf.py", "stand_in": STAND_IN}
    said = {"tokenize": run(README_COMMANDS[0], folder).stdout.strip()}
    train = run(README_COMMANDS[1], folder)
    said["train"] = [x for x in train.stdout.splitlines() if x.startswith(("continuing", "mpi_tp", "done", "memory"))]
    answer = serve_and_ask(README_COMMANDS[2], folder)
    said["serve"] = {"text": answer["choices"][0]["text"], "usage": answer["usage"]}
    said["export"] = run(README_COMMANDS[3], folder).stdout.strip()
    evals = [json.loads(run(f"mpiexec -n 2 mpi-tp eval --checkpoint {c} --data data/pydoc.bin --json",
                            folder).stdout.splitlines()[-1])["loss"] for c in ("runs/ft/checkpoints", "ft-hf")]
    out.update(said=said, eval_checkpoint=evals[0], eval_export=evals[1])
    assert abs(evals[0] - evals[1]) < 1e-5 * evals[0], evals
    try:
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(WORK, "ft-hf"))
        out["transformers_loads"] = type(model).__name__
    except ImportError:
        out["transformers_loads"] = "transformers not installed"
    with open(os.path.join(WORK, "runs/ft/run.json")) as f:
        mem = json.load(f)["memory_mib"]
    held = [mem["weights"][r] + mem["gradients"][r] + mem["optimizer"][r] for r in range(4)]
    out["measured_mib"] = {**mem, "state_max": max(held)}
    out["formula_mib"] = state_mib(STAND_IN, 2, 2, True)
    out["published"] = {name: {f"tp{T} dp{D}{' zero1' if z else ''}": round(state_mib(m, T, D, z), 1)
                               for T, D, z in ((1, 1, False), (2, 2, False), (2, 2, True), (4, 1, False), (8, 1, False))}
                        for name, m in PUBLISHED.items()}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("said", "eval_checkpoint", "eval_export", "transformers_loads")}, indent=1))
    print(f"model state per rank: measured {out['measured_mib']['state_max']:.2f} MiB (largest rank), formula "
          f"{out['formula_mib']:.2f} MiB; peak resident {max(mem['peak_rss']):.0f} MiB")
    for name, row in out["published"].items():
        print(f"{name:>16}: " + ", ".join(f"{k} {v / 1024:.2f} GiB" for k, v in row.items()))


if __name__ == "__main__":
    main()
