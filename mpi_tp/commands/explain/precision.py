"""`mpi-tp explain --layer precision`: what a block keeps and what a parameter costs at bf16 beside fp32.

    mpiexec -n 2 mpi-tp explain --layer precision --features 64 --seq 32      # T = 2

Builds the same transformer block (tensor-parallel over T = world size, same seed) in fp32 and in bf16,
runs one forward and backward pass and an AdamW step, and prints, measured on this rank's arrays:
the activations the block keeps for its backward, term by term (mpi_tp.planning.activations), beside
Korthikanti et al.'s 34 S B C + 5 H S^2 B bytes at 2-byte values (T = 1; with T, their (10 + 24/T) S B C
+ 5 H S^2 B / T); and the model state per parameter, 16 bytes either way: fp32 4 + 4 + 8, bf16 2 + 2 + 12
(bf16 weights and gradients, fp32 master weights and AdamW's two moments). Exit status 0 when the bf16
activations are half of fp32's within 2% and the state is 16 bytes per parameter.
"""
from __future__ import annotations

import numpy
from mpi4py import MPI

from mpi_tp.core.precision import dtype_of
from mpi_tp.core.runtime import rank0_print
from mpi_tp.core.testing import all_true
from mpi_tp.model.block import Block
from mpi_tp.model.config import GPTConfig, fewest_heads
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.activations import activation_bytes_per_layer, measured_terms
from mpi_tp.training.optim import AdamW

LESSON = ("Mixed precision keeps parameters, activations and gradients in bf16 and the optimizer's master weights "
          "and moments in fp32: a block keeps half the activation bytes (its normalised inputs, q, k, v, softmax "
          "output, GELU input and tanh at 2 bytes; the per-row 1/std stays fp32), and each parameter costs "
          "2 + 2 + 12 = 16 bytes, as many as fp32's 4 + 4 + 8: the memory saved is the activations', and the "
          "wire bytes of every collective (ZeRO-1 shards the 12).")


def _measure(dtype: str, C: int, H: int, S: int, B: int, topo) -> tuple[dict, dict]:
    """(activation bytes by term, state bytes by kind) of one block in `dtype` after a step."""
    block = Block(0, GPTConfig(n_layer=1, n_head=H, n_embd=C, block_size=S), topo, dtype_of(dtype), 0)
    x = numpy.random.default_rng(0).standard_normal((B, S, C)).astype(numpy.float32).astype(dtype_of(dtype))
    block.forward(x)
    terms = measured_terms(block)
    block.backward(x)
    opt = AdamW(block.parameters())
    opt.step()
    n = sum(p.data.size for p in block.parameters())
    state = {"weights": sum(p.data.nbytes for p in block.parameters()),
             "grads": sum(p.grad.nbytes for p in block.parameters()),
             "master": sum(a.nbytes for a in opt.state.get("master", [])),
             "moments": sum(a.nbytes for k, arrays in opt.state.items() if k != "master" for a in arrays)}
    return terms, {k: v / n for k, v in state.items()}


def lesson(args, comm) -> bool:
    T = comm.Get_size()
    C, S, B = args.features, args.seq, args.batch
    H = args.heads or fewest_heads(C, T)
    topo = Topology.create(comm)
    (t32, s32), (t16, s16) = (_measure(d, C, H, S, B, topo) for d in ("float32", "bfloat16"))
    most = {k: comm.allreduce(v, op=MPI.MAX) for k, v in (("fp32", sum(t32.values())), ("bf16", sum(t16.values())))}
    paper = activation_bytes_per_layer(S, B, C, H, T, paper=True)          # 2-byte values, dropout on
    paper_no_masks = paper - (H * S * S * B / T + 2 * S * B * C)            # their three 1-byte masks off
    lines = [(f"a block at C = {C}, H = {H}, S = {S}, B = {B}, T = {T} (same seed); bytes kept for the backward "
              "pass, this rank's, term by term:"), f"  {'term':<28}{'fp32':>10}{'bf16':>10}{'bf16/fp32':>11}"]
    lines += [f"  {k:<28}{t32[k]:>10}{t16.get(k, 0):>10}{t16.get(k, 0) / t32[k]:>11.3f}" for k in t32]
    ratio = most["bf16"] / most["fp32"]
    lines.append(f"  {'total (most on any rank)':<28}{most['fp32']:>10}{most['bf16']:>10}{ratio:>11.3f}")
    form = "34 S B C + 5 H S^2 B" if T == 1 else f"(10 + 24/{T}) S B C + 5 H S^2 B / {T}"
    lines.append(f"Korthikanti et al.'s count at 2-byte values ({form}; masks are 1 byte): "
                 f"{paper:.0f} bytes; without the dropout masks this run has none of, {paper_no_masks:.0f}; "
                 f"measured at bf16 {most['bf16']} (ours also keeps GELU's tanh, 4 S B C / T values, and the "
                 "fp32 1/std, and not the dropout output)")
    for name, s in (("fp32", s32), ("bf16", s16)):
        parts = " + ".join(f"{k} {v:g}" for k, v in s.items() if v)
        lines.append(f"model state per parameter, {name}: {parts} = {sum(s.values()):g} bytes")
    ok = abs(ratio - 0.5) <= 0.01 and sum(s16.values()) == sum(s32.values()) == 16
    rank0_print(f"\n== precision ==\n{LESSON}\n" + "\n".join(lines) +
                f"\nbf16 activations 0.50x fp32's within 2%, 16 bytes per parameter: {'yes' if ok else 'no'}", comm=comm)
    topo.free()
    return all_true(ok, comm)
