"""Peak activation memory per pipeline stage, measured, next to the closed form: GPipe, 1F1B and
1F1B with selective and full recomputation.

    mpiexec -n 2 python -m mpi4py experiments/pipeline/pipeline_memory.py      # appends to its results/:
                                                                               # pipeline_memory_large.jsonl

At one shape (default C 512, 8 heads, 8 blocks, S 256, micro-batches of one
sequence, M = 8, float32) each mode runs `mpi-tp bench --pp`'s measurement
(commands.bench.pipeline.run_pipeline_shape with --steps timed steps after
--warmup): each stage counts the bytes of the forward caches it keeps for
backward passes still to come (PipelineStage.count_activations) and reports the
peak over the last step. The closed form per stage s of P holding L_s blocks:

    in_flight x L_s x per_layer,    in_flight = M (GPipe), min(P - s, M) (1F1B)

with per_layer = activation_bytes_per_layer (mpi_tp.planning) (this implementation's
form, 4 bytes x (S B C (4 + 16 / T) + H S^2 B / T)), less the H S^2 B / T term
under selective recomputation, and the block's input alone (4 S B C / T)
under full recomputation. It counts the transformer blocks only. The second
closed form ("with ends") adds, per micro-batch in flight, what this code's
caches hold besides (read from mpi_tp/model: LayerNorm keeps its 1/std,
(s b) values, twice per block; the first chunk keeps the token ids, 8 s b
bytes; the last chunk keeps ln_f's normalised input and 1/std, the output
layer's input, the softmax and the targets: s b (8 h + 4 V + 13) bytes).
Neither counts the short-lived activations of the block that a backward pass
under recomputation is rebuilding: the measurement counts only what is held
between actions. One JSON line per mode, with both closed forms and the
1-minute load average at the start and end.
"""
import argparse
import json
import os
import sys
from types import SimpleNamespace

from mpi4py import MPI

from mpi_tp.commands.bench import environment
from mpi_tp.commands.bench.pipeline import run_pipeline_shape
from mpi_tp.parallel.pipeline.stages import layer_ranges
from mpi_tp.planning.costmodel import Plan, Workload

try:                                                  # the cost model's memory part, wherever it lives
    from mpi_tp.planning.memory import activation_bytes_per_layer
except ImportError:
    from mpi_tp.planning.costmodel import activation_bytes_per_layer

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = (("gpipe", "none"), ("1f1b", "none"), ("1f1b", "selective"), ("1f1b", "full"))


def closed_form(C, H, L, S, B, P, M, schedule, recompute, t=1, vocab=256, ends=False) -> list[float]:
    """Bytes of block activations each stage holds at its peak (see the module docstring);
    ends: also the LayerNorms' 1/std and the first and last chunks' caches (t = 1 only)."""
    per_layer = activation_bytes_per_layer(SimpleNamespace(activations="mpi_tp"),
                                           Workload(n_layer=L, n_embd=C, n_head=H, seq=S, global_batch=B * M),
                                           Plan(tp=t, pp=P, micro_batch=B))
    if recompute == "selective":
        per_layer -= 4 * H * S * S * B / t
    elif recompute == "full":
        per_layer = 4 * S * B * C / t
    out = []
    for s, chunks in enumerate(layer_ranges(L, P)):
        in_flight = M if schedule == "gpipe" else min(P - s, M)
        blocks = sum(len(r) for r in chunks)
        extra = 0
        if ends:
            extra = blocks * 8 * S * B if recompute != "full" else 0              # 2 x 1/std per block
            extra += 8 * S * B if s == 0 else 0                                   # token ids (int64)
            extra += S * B * (8 * C + 4 * vocab + 13) if s == P - 1 else 0        # ln_f, head, softmax, targets
        out.append(in_flight * (blocks * per_layer + extra))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="512,8,8,256,1", help="C,H,L,S,B (B: the micro-batch size)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--results", default=os.path.join(HERE, "results", "pipeline_memory_large.jsonl"),
                    help="JSON lines appended here")
    args = ap.parse_args()
    C, H, L, S, B = (int(v) for v in args.shape.split(","))
    comm, M = MPI.COMM_WORLD, args.micro_batches
    P, rank = comm.Get_size(), comm.Get_rank()
    command = f"mpiexec -n {P} python -m mpi4py experiments/pipeline/pipeline_memory.py " + " ".join(sys.argv[1:])
    env = environment(comm)
    lines = []
    for schedule, recompute in MODES:
        load0 = os.getloadavg()
        r = run_pipeline_shape(comm, C=C, H=H, L=L, S=S, B=B, steps=args.steps, warmup=args.warmup,
                               dtype="float32", tp=1, pp=P, dp=1, micro_batches=M, schedule=schedule,
                               recompute=recompute, seed=0)
        load1 = os.getloadavg()
        closed = [b / 2**20 for b in closed_form(C, H, L, S, B, P, M, schedule, recompute)]
        whole = [b / 2**20 for b in closed_form(C, H, L, S, B, P, M, schedule, recompute, ends=True)]
        measured = r["peak_activation_mb_per_stage"]
        r.update(experiment="pipeline_memory", command=command.strip(), environment=env,
                 closed_form_mb_per_stage=closed, measured_over_closed=[m / c for m, c in zip(measured, closed)],
                 closed_form_with_ends_mb_per_stage=whole,
                 measured_over_closed_with_ends=[m / c for m, c in zip(measured, whole)],
                 loadavg_start=list(load0), loadavg_end=list(load1))
        if rank == 0:
            with open(args.results, "a") as f:
                f.write(json.dumps(r) + "\n")
            for s in range(P):
                lines.append(f"| {schedule} | {recompute} | {s} | {measured[s]:.2f} | {closed[s]:.2f} | "
                             f"{measured[s] / closed[s]:.3f} | {whole[s]:.2f} | {measured[s] / whole[s]:.4f} | "
                             f"{r['step_ms']['median']:.0f} | {r['bubble']['measured']:.3f} | "
                             f"{load0[0]:.2f} / {load1[0]:.2f} |")
            print(lines[-P], flush=True)
    if rank == 0:
        print(f"\nC {C}, {H} heads, {L} blocks, S {S}, b {B}, M {M}, P {P}, float32 ({env['date']})\n")
        print("| schedule | recompute | stage | measured MiB | closed form (blocks) MiB | ratio | with ends MiB "
              "| ratio | step ms | bubble | load start / end |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(lines))
        print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
