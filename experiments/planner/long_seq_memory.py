"""The planner's activation memory at long sequences against what `mpi-tp bench` measures for the same layout,
scaled down to what this machine holds (issue 43): bench's model (GPT-2's shape; Llama's layer is checked in
tests/test_plan_long.py) of 2 blocks, C 256, 8 heads, one sequence of S = 2048 ... 8192 positions, float32, on one
rank and at cp 2.

    python experiments/planner/long_seq_memory.py                                   # cp 1
    mpiexec -n 2 python -m mpi4py experiments/planner/long_seq_memory.py            # cp 2
    ... --out experiments/planner/results/long_seq_memory.jsonl                     # append the rows (rank 0)

Each row: bench's one metered step (mpi_tp.commands.bench.step.run_shape: block 0's caches after a forward on the
largest rank, and the step's peak of live activation arrays by mpi_tp.core.memory.MemoryMeter), beside the
planner's count for that layout (mpi_tp.planning.memory on a machine of this code's float32 count: per layer, and
the stage's activations with the logits, memory_per_rank). The per-layer figures are equal by construction of the
test that guards them (tests/test_plan_long.py); the stage's are the check: what the planner multiplies the layer
by against what a step holds at once.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from mpi4py import MPI  # noqa: E402

from mpi_tp.commands.bench import step as bench  # noqa: E402
from mpi_tp.model.config import GPTConfig  # noqa: E402
from mpi_tp.planning.costmodel import Plan  # noqa: E402
from mpi_tp.planning.machines import Machine  # noqa: E402
from mpi_tp.planning.memory import activation_bytes_per_layer, memory_per_rank  # noqa: E402
from mpi_tp.planning.workload import Workload  # noqa: E402

HERE_MACHINE = Machine(name="this code", ranks_per_node=2, gemm_flops=1e10, elem_rate=1e9, mem_bw=1e10,
                       mem_bytes=24e9, intra_alpha=1e-5, intra_bw=1e9, inter_alpha=1e-5, inter_bw=1e9,
                       bytes_per_value=4)
C, H, L = 256, 8, 2


def row(comm, S: int) -> dict:
    Z = comm.Get_size()
    r = bench.run_shape(comm, C, H, L, S, 1, steps=1, warmup=0, cp=Z)
    w = Workload(L, C, H, S, 1, vocab=GPTConfig().vocab_size)
    lay = Plan(cp=Z, dp=1, micro_batch=1)
    mem = memory_per_rank(HERE_MACHINE, w, lay)
    peak = r["memory_measured"]["max"]
    return {"seq": S, "cp": Z, "layer_measured": r["activation_bytes_per_layer"],
            "layer_planner": activation_bytes_per_layer(HERE_MACHINE, w, lay),
            "step_activations_measured": peak["activations"], "planner_activations": mem["activations"],
            "planner_logits": mem["logits"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--out", default=None, help="append the rows as JSON lines (rank 0)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rows = [row(comm, S) for S in args.seq]
    if comm.Get_rank():
        return
    mib = 2 ** 20
    print("| S | cp | a layer, measured MiB | planner | the step's activations at their peak, measured MiB "
          "| planner: activations + logits | ratio |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        plan = x["planner_activations"] + x["planner_logits"]
        print(f"| {x['seq']} | {x['cp']} | {x['layer_measured'] / mib:.2f} | {x['layer_planner'] / mib:.2f} "
              f"| {x['step_activations_measured'] / mib:.2f} | {plan / mib:.2f} "
              f"| {plan / x['step_activations_measured']:.3f} |")
    if args.out:
        with open(args.out, "a") as f:
            for x in rows:
                f.write(json.dumps(x) + "\n")


if __name__ == "__main__":
    main()
