"""Where a step's time goes, kernel by kernel, against what the machine allows (issue 26): cProfile, T = 1.

    OMP_NUM_THREADS=1 python experiments/kernels/profile_step.py                  # training, shape a: C 256, 4 heads,
                                                                          # 4 blocks, S 128, B 8
    OMP_NUM_THREADS=1 python experiments/kernels/profile_step.py --shape 1024,16,2,128,4      # training, shape c
    OMP_NUM_THREADS=1 python experiments/kernels/profile_step.py --decode 4       # a decode step of 4 rows, shape c
                                                                          # (a 64-byte prompt each)

Runs warm-up steps, then --steps profiled ones (training: forward, backward, clipping, AdamW; decoding:
Decoder.step), and prints per kernel its own time (cProfile's tottime: a kernel's NumPy calls count in
it, the Python layers above them do not; the softmax, kernels_attention.softmax_rows, counts in the rows
of the kernels calling it) in ms per step, its share of the step, and its limit: the time
the kernel's work would take at this machine's rates, measured in the same run, the larger of

    FLOPs / GEMM rate      (a 2048^3 float32 GEMM on this core)
    bytes / memory rate    (a 64 MiB copy: bytes read + written per second; decoding's weights are
                            read once per step, rated by the read-only x @ W of mpi-tp bench)

with the work counted from the shape (the formulas are in `work` below); "x limit" = measured / limit.
A kernel far above its limit is where time is lost; one near it is done. A busy machine stretches every
time: read the shares and ratios, and measure on a quiet one. One JSON line per run in
experiments/kernels/results/profile_step.jsonl.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import numpy
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from mpi_tp.commands.bench.inference import memory_bandwidth  # noqa: E402
from mpi_tp.commands.bench.yardsticks import gemm_peak  # noqa: E402
from mpi_tp.core.runtime import keep_freed_memory, machine_text  # noqa: E402
from mpi_tp.model.config import GPTConfig  # noqa: E402
from mpi_tp.model.gpt import GPT  # noqa: E402
from mpi_tp.training.optim import AdamW, clip_coefficient  # noqa: E402

OUT = os.path.join(HERE, "results", "profile_step.jsonl")
V, F4 = 256, 4                      # byte vocabulary; float32
FOLDED = {"softmax_rows"}           # counted in their callers' rows (attention_forward, _softmax_times_v)


def work(C, H, L, S, B, decode=0) -> dict:
    """{kernel: (FLOPs, bytes moved)} per step. Training: N = B S rows; the linear layers' three products
    (forward, dX, dW: mpi_tp.core.blas.matmul; linear_forward keeps only the bias and reshapes) 2 N
    (12 L C^2 + V C) FLOPs each, the weights' bytes negligible; attention over the full S x S (S <= 128:
    the dense path), 4 B S^2 C L forward and twice that backward (kernels_attention._backward_rows), each
    (S, S) array written and read once per pass; GELU (N, 4C) per block: forward reads x, writes y and
    tanh; backward reads dy, x, tanh, writes dx; LayerNorm (N, C), 2L + 1 of them: read x, write x_hat
    and y / read dy and x_hat, write dx; AdamW over P parameters reads w, g, m, v and writes w, m, v.
    Decoding (decode = rows): the linear products (kernels._few_rows up to 8 rows, else one matmul) read
    every weight once, 2 rows (12 L C^2 + V C) FLOPs; attention reads the rows' cached keys and values.
    NumPy's own reductions and einsums are listed apart, without a limit."""
    P = 12 * L * C * C + V * C
    if decode:
        kv = 2 * L * decode * S * C * F4
        weights = (2 * decode * P, P * F4)             # by panels (_few_rows) up to 8 rows, else one matmul
        return {"_few_rows": weights, "matmul": weights, "_scores": (0, kv / 2), "_softmax_times_v": (0, kv / 2)}
    N, n_mm = B * S, 2 * B * S * P
    att, hid, ln = B * H * S * S * F4, N * 4 * C * F4, 3 * N * C * F4 * (2 * L + 1)
    return {"matmul": (3 * n_mm, 0),
            "attention_forward": (4 * B * S * S * C * L, 3 * att * L), "_backward_rows": (8 * B * S * S * C * L,
                                                                                         5 * att * L),
            "gelu_forward": (0, 3 * hid * L), "gelu_backward": (0, 4 * hid * L),
            "layernorm_forward": (0, ln), "layernorm_backward": (0, ln),
            "step": (0, 7 * P * F4)}


def copy_rate(mib=64, reps=7) -> float:
    """GB/s of bytes read + written by a copy of mib MiB (the fastest of reps)."""
    a = numpy.ones(mib * 2 ** 18, dtype=numpy.float32)
    b = numpy.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        numpy.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best / 1e9


def training_step(C, H, L, S, B):
    model = GPT(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), dtype="float32", seed=0)
    opt = AdamW(model.parameters(), lr=1e-4)
    x = numpy.random.default_rng(0).integers(0, V, (B, S + 1))

    def step():
        model.zero_grad()
        model.forward(x[:, :-1], x[:, 1:])
        model.backward()
        opt.step(grad_scale=clip_coefficient(opt.grad_norm(model.topo.tp), 1.0))
    return step


def decode_step(C, H, L, S, rows, prompt=64):
    from mpi_tp.inference.decode import Decoder
    dec = Decoder(GPT(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), dtype="float32", seed=0), rows)
    rng = numpy.random.default_rng(0)
    ids = rng.integers(0, V, rows)

    def step():
        if dec.cache.lengths[:rows].max() >= S - 1:            # keep within the cache: prefill again
            dec.prefill([bytes(rng.integers(0, V, prompt).tolist()) for _ in range(rows)])
        dec.step(ids)
    dec.prefill([bytes(rng.integers(0, V, prompt).tolist()) for _ in range(rows)])
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=None, help="C,H,L,S,B (default: shape a; with --decode shape c)")
    ap.add_argument("--decode", type=int, default=0, metavar="ROWS", help="profile a decode step of ROWS rows")
    ap.add_argument("--steps", type=int, default=None, help="profiled steps (default 10; decoding 40)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    shape = args.shape or ("1024,16,2,128,1" if args.decode else "256,4,4,128,8")
    C, H, L, S, B = (int(v) for v in shape.split(","))
    steps = args.steps or (40 if args.decode else 10)
    keep_freed_memory()                                   # as mpi-tp train and bench do
    peak, copy = gemm_peak(MPI.COMM_SELF), copy_rate()
    read = memory_bandwidth(MPI.COMM_SELF) if args.decode else copy
    step = decode_step(C, H, L, S, args.decode) if args.decode else training_step(C, H, L, S, B)
    for _ in range(3):
        step()
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    per_step = (time.perf_counter() - t0) / steps
    stats = pstats.Stats(profile).stats
    own = {key: v[2] for key, v in stats.items()}
    for key, v in stats.items():                          # a shared helper's time goes to the kernels calling it
        if key[2] in FOLDED:
            for caller, (_, _, tt, _) in v[4].items():
                own[caller] = own.get(caller, 0.0) + tt
            own.pop(key)
    rows = sorted(((f"{os.path.basename(f)}:{name}", name, t / steps) for (f, _, name), t in own.items()),
                  key=lambda r: -r[2])[:args.top]
    limits = work(C, H, L, S, B, args.decode)
    what = f"decode step of {args.decode} rows" if args.decode else "training step"
    print(f"{machine_text()}; C={C} H={H} L={L} S={S} B={args.decode or B}, float32, T = 1, {what}: "
          f"{1e3 * per_step:.1f} ms per step (profiled); GEMM {peak:.0f} GFLOP/s, copy {copy:.1f} GB/s, "
          f"read {read:.1f} GB/s\n{'function':<44} {'ms/step':>8} {'share':>6} {'limit ms':>9} {'x limit':>8}")
    out = []
    for full, name, sec in rows:
        limit = None
        if name in limits:
            flops, nbytes = limits[name]
            limit = max(flops / (peak * 1e9), nbytes / ((read if args.decode else copy) * 1e9))
        print(f"{full:<44} {1e3 * sec:>8.2f} {100 * sec / per_step:>5.1f}% "
              + (f"{1e3 * limit:>9.2f} {sec / limit:>8.2f}" if limit else f"{'':>9} {'':>8}"))
        out.append([full, 1e3 * sec] + ([1e3 * limit] if limit else []))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "a") as f:
        f.write(json.dumps({"machine": machine_text(), "shape": [C, H, L, S, B], "decode_rows": args.decode,
                            "step_ms": 1e3 * per_step, "gemm_gflops": peak, "copy_gbs": copy, "read_gbs": read,
                            "date": time.strftime("%Y-%m-%d %H:%M"),
                            "command": "python experiments/kernels/profile_step.py " + " ".join(sys.argv[1:]),
                            "top": out}) + "\n")


if __name__ == "__main__":
    main()
