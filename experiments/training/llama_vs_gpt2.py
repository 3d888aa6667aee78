"""The Llama architecture beside GPT-2 at shape c's size: training tokens/s, decode latency, KV-cache bytes.

    mpiexec -n 1 python -m mpi4py experiments/training/llama_vs_gpt2.py
    mpiexec -n 2 python -m mpi4py experiments/training/llama_vs_gpt2.py      # T = 2 (appends to the same file)

Three models of C 1024, 16 heads, 2 blocks, S 128 (float32, one BLAS thread per rank): GPT-2 (shape c
of `mpi-tp bench`: LayerNorm, GELU MLP of 4C, learned positions, biases), Llama with 16 key/value
heads (MHA) and Llama with 4 (GQA, R = 4); the Llama MLP width F = 2816 (SwiGLU's three matrices,
8.25 C^2 per block against GPT-2's 8 C^2). Per model: the median of 10 timed training steps (after 3)
of batch 4 (forward, backward, finalize_grads, AdamW), and the median decode step (Decoder.step, one
new position per row) at batch 1 and 8 after a 64-byte prefill, with the KV cache's bytes on rank 0
at block_size. The models alternate step for step within each measurement, to share the machine's
drift. One JSON line per model and T in experiments/training/results/llama_vs_gpt2.jsonl (machine, command).
"""
import json
import os
import sys
import time

import numpy
from mpi4py import MPI

from mpi_tp.core.runtime import machine_text
from mpi_tp.inference.decode import Decoder
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.finalize import finalize_grads
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "llama_vs_gpt2.jsonl")
C, H, L, S, B = 1024, 16, 2, 128, 4
MODELS = {"gpt2": dict(arch="gpt2"),
          "llama MHA": dict(arch="llama", n_kv_head=16, intermediate_size=2816, tie_word_embeddings=True),
          "llama GQA 4": dict(arch="llama", n_kv_head=4, intermediate_size=2816, tie_word_embeddings=True)}


def build(comm, spec):
    topo = Topology.create(comm, tp=comm.Get_size())
    cfg = GPTConfig(vocab_size=256, block_size=S, n_layer=L, n_head=H, n_embd=C, **spec)
    return GPT(cfg, topo, dtype="float32", seed=0)


def train_steps(comm, models, steps=10, warmup=3) -> dict:
    rng = numpy.random.default_rng(0)
    x, y = rng.integers(0, 256, (B, S)), rng.integers(0, 256, (B, S))
    opts = {k: AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times = {k: [] for k in models}
    for i in range(warmup + steps):
        for k, m in models.items():                   # alternate: the same drift for every model
            comm.Barrier()
            t0 = time.perf_counter()
            m.zero_grad()
            m.forward(x, y)
            m.backward()
            finalize_grads(m, None)
            opts[k].step()
            if i >= warmup:
                times[k].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return {k: float(numpy.median(v)) for k, v in times.items()}


def decode_steps(comm, models, batch, new=32) -> tuple[dict, dict]:
    rng = numpy.random.default_rng(1)
    prompts = [bytes(rng.integers(0, 256, 64).tolist()) for _ in range(batch)]
    decs = {k: Decoder(m.eval(), batch) for k, m in models.items()}
    logits = {k: d.prefill(prompts) for k, d in decs.items()}
    times = {k: [] for k in models}
    for _ in range(new):
        for k, d in decs.items():
            nxt = logits[k].argmax(axis=1)
            comm.Barrier()
            t0 = time.perf_counter()
            logits[k] = d.step(nxt)
            times[k].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    cache = {k: d.cache.nbytes for k, d in decs.items()}
    for m in models.values():
        m.train()
    return {k: float(numpy.median(v)) for k, v in times.items()}, cache


def main():
    comm = MPI.COMM_WORLD
    models = {k: build(comm, spec) for k, spec in MODELS.items()}
    train = train_steps(comm, models)
    dec1, cache1 = decode_steps(comm, models, 1)
    dec8, cache8 = decode_steps(comm, models, 8)
    if comm.Get_rank() != 0:
        return
    stamp = {"machine": machine_text(), "command": " ".join(["mpiexec", "-n", str(comm.Get_size()), "python",
                                                              "-m", "mpi4py"] + sys.argv),
             "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg": os.getloadavg()[0]}
    print(f"T = {comm.Get_size()}: model, parameters, train tok/s (B {B} S {S}), decode ms/step at batch 1 and 8, "
          f"KV cache MiB per rank (batch 1, block_size {S})")
    with open(OUT, "a") as f:
        for k, m in models.items():
            row = {"model": k, "tp": comm.Get_size(), "parameters": m.num_params(), **MODELS[k],
                   "train_tokens_per_s": B * S / train[k], "decode_ms_batch1": 1e3 * dec1[k],
                   "decode_ms_batch8": 1e3 * dec8[k], "kv_cache_bytes_batch1": cache1[k],
                   "kv_cache_bytes_batch8": cache8[k], **stamp}
            f.write(json.dumps(row) + "\n")
            print(f"  {k:12s} {row['parameters']:>10,} {row['train_tokens_per_s']:8,.0f} "
                  f"{row['decode_ms_batch1']:7.2f} {row['decode_ms_batch8']:7.2f} {cache1[k] / 2**20:7.2f}")


if __name__ == "__main__":
    main()
