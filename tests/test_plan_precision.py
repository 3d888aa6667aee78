"""`mpi-tp plan --precision`: the planner's bytes per value and model state at the format trained in.

Mixed-precision AdamW keeps 16 bytes per parameter, 2 + 2 + 12 (bf16 weights and gradients, fp32 masters
and two moments; ZeRO-1 shards the 12), fp32 AdamW 4 + 4 + 8; activations and every wire byte at the
value width, the per-row statistics in fp32 (tests/test_memory_model.py checks both against real runs).
"""
import json
import subprocess
import sys

import pytest

from mpi_tp.planning.costmodel import Plan, Workload, step_time
from mpi_tp.planning.machines import PRESETS, Machine, state_bytes, with_precision
from mpi_tp.planning.memory import memory_per_rank

CPU = Machine(name="test", ranks_per_node=8, gemm_flops=1e11, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e10,
              intra_alpha=1e-5, intra_bw=1e10, inter_alpha=1e-4, inter_bw=1e9)
W = Workload(n_layer=2, n_embd=64, n_head=4, seq=32, global_batch=8, vocab=256)


def test_state_bytes_per_parameter():
    assert state_bytes(CPU) == {"weights": 4, "grads": 4, "master": 0, "moments": 8}          # fp32: 16
    assert state_bytes(with_precision(CPU, "bf16")) == {"weights": 2, "grads": 2, "master": 4, "moments": 8}
    assert state_bytes(with_precision(CPU, "fp16")) == state_bytes(with_precision(CPU, "bf16"))
    assert state_bytes(PRESETS["dgx-a100"]) == {"weights": 2, "grads": 4, "master": 4, "moments": 8}  # Megatron: 18
    assert state_bytes(with_precision(CPU, "bf16", grad_bytes=4))["grads"] == 4       # gradients reduced in fp32


def test_bf16_halves_values_and_keeps_fp32_masters():
    fp32, bf16 = (memory_per_rank(with_precision(CPU, p), W, Plan(tp=2, micro_batch=8)) for p in ("fp32", "bf16"))
    mine = (2 * (12 * 64 * 64 + 7 * 64) + 256 * 64) / 2 + 2 * 6 * 64 + 32 * 64 + 2 * 64     # a rank's parameters
    assert (fp32["weights_grads"], fp32["optimizer"]) == (mine * 8, mine * 8)
    assert (bf16["weights_grads"], bf16["optimizer"]) == (mine * 4, mine * 12)
    zero = memory_per_rank(with_precision(CPU, "bf16"), W, Plan(tp=2, dp=4, micro_batch=2, zero=1))
    assert (zero["weights_grads"], zero["optimizer"]) == (mine * (4 + 2 / 4), mine * 12 / 4)   # the 12 sharded
    # activations: every value at 2 bytes, the LayerNorms' 1/std (2 S B per layer) at 4 either way
    sb = 32 * 8
    assert bf16["activations"] - 2 * 2 * 4 * sb == pytest.approx((fp32["activations"] - 2 * 2 * 4 * sb) / 2)
    rows, head = 32 * 8, 2 * 32 * 8 * 64                                 # the output layer's inputs: 2 S B C
    assert fp32["logits"] == rows * 256 / 2 * 8 + head * 4
    assert bf16["logits"] == rows * 256 / 2 * 6 + head * 2                # bf16 logits, the softmax in fp32


def test_wire_bytes_follow_the_precision():
    """The tensor-parallel all-reduces and the gradient all-reduce move 2-byte values at bf16: with no
    latency and nothing else in the step, each takes half the time."""
    m = CPU.__class__(**{**CPU.__dict__, "intra_alpha": 0.0, "inter_alpha": 0.0})
    t32, t16 = (step_time(with_precision(m, p), W, Plan(tp=2, dp=4, micro_batch=2, overlap_dp=False))
                for p in ("fp32", "bf16"))
    assert t16["tp_comm"] == pytest.approx(t32["tp_comm"] / 2) and t16["dp_comm"] == pytest.approx(t32["dp_comm"] / 2)


def test_plan_command_takes_the_precision():
    model = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--global-batch", "8"]
    out = {}
    for p in ("fp32", "bf16"):
        r = subprocess.run([sys.executable, "-m", "mpi_tp", "plan", *model, "--precision", p, "--tp", "2", "--pp", "1",
                            "--micro-batch", "2", "--no-sp", "--no-zero", "--no-recompute", "--json"],
                           check=False, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[p] = json.loads(r.stdout)
    assert out["bf16"]["bytes_per_value"] == 2 and out["bf16"]["state_bytes_per_param"]["master"] == 4
    mem = {p: o["ranked"][0]["memory_bytes"] for p, o in out.items()}
    assert mem["bf16"]["weights_grads"] == mem["fp32"]["weights_grads"] / 2
    assert mem["bf16"]["optimizer"] == mem["fp32"]["optimizer"] * 12 / 8
