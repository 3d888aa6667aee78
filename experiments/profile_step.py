"""Where a training step's time goes, kernel by kernel (issue 26): cProfile over timed steps of one shape, T = 1.

    OMP_NUM_THREADS=1 python experiments/profile_step.py                  # shape a: C 256, 4 heads, 4 blocks, S 128, B 8
    OMP_NUM_THREADS=1 python experiments/profile_step.py --shape 1024,16,2,128,4      # shape c

Runs 3 warm-up steps, then 10 profiled ones (forward, backward, clipping, AdamW), and prints the functions
that take the most time of their own (cProfile's tottime: a kernel's NumPy calls count in it, the Python
layers above them do not), in ms per step and as a share of the step, with the machine and the command.
Each kernel's limit is the next question: the GEMMs against the GEMM rate `mpi-tp bench` measures, the
elementwise kernels against the memory bandwidth (the bytes they read and write per step over it). A
busy machine stretches every time: read the shares, and measure on a quiet one. One JSON line per run in
experiments/results/profile_step.jsonl.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpi_tp.core.runtime import keep_freed_memory, machine_text  # noqa: E402
from mpi_tp.model.config import GPTConfig  # noqa: E402
from mpi_tp.model.gpt import GPT  # noqa: E402
from mpi_tp.training.optim import AdamW, clip_coefficient  # noqa: E402

OUT = os.path.join(HERE, "results", "profile_step.jsonl")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="256,4,4,128,8", help="C,H,L,S,B (default shape a)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    C, H, L, S, B = (int(v) for v in args.shape.split(","))
    keep_freed_memory()                                   # as mpi-tp train and bench do
    model = GPT(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), dtype="float32", seed=0)
    opt = AdamW(model.parameters(), lr=1e-4)
    x = numpy.random.default_rng(0).integers(0, 256, (B, S + 1))

    def step():
        model.zero_grad()
        model.forward(x[:, :-1], x[:, 1:])
        model.backward()
        opt.step(grad_scale=clip_coefficient(opt.grad_norm(model.topo.tp), 1.0))
    for _ in range(3):
        step()
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    per_step = (time.perf_counter() - t0) / args.steps
    stats = pstats.Stats(profile).stats
    rows = sorted(((f"{os.path.basename(f)}:{name}", v[2] / args.steps) for (f, _, name), v in stats.items()),
                  key=lambda r: -r[1])[:args.top]
    print(f"{machine_text()}; C={C} H={H} L={L} S={S} B={B}, float32, T = 1: {1e3 * per_step:.1f} ms per step "
          f"(profiled)\n{'function':<48} {'ms/step':>8} {'share':>6}")
    for name, sec in rows:
        print(f"{name:<48} {1e3 * sec:>8.2f} {100 * sec / per_step:>5.1f}%")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "a") as f:
        f.write(json.dumps({"machine": machine_text(), "shape": [C, H, L, S, B], "step_ms": 1e3 * per_step,
                            "command": "python experiments/profile_step.py --shape " + args.shape,
                            "top": [[n, 1e3 * s] for n, s in rows]}) + "\n")


if __name__ == "__main__":
    main()
