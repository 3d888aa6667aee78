"""Tests for mpi_tp.core.kernels_llama (RMSNorm, rotary embeddings, SwiGLU) and grouped-query attention's
broadcast through kernels.attention_forward/backward.

    .venv/bin/python -m pytest -q tests/test_kernels_llama.py

Each backward against central finite differences in float64 (every input element, small shapes), each
forward against a reference written here; float32 stays float32; and, when transformers is installed,
its Llama functions (LlamaRMSNorm, LlamaRotaryEmbedding with apply_rotary_pos_emb, SiLU) give the same
numbers, so converted checkpoints compute what they computed there. No MPI.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_kernels import FD_TOL, Case, check, numerical_grad

from mpi_tp.core import kernels as kern
from mpi_tp.core import kernels_llama as kl


def rmsnorm_case(rng, dtype, shape=(2, 3, 4), eps=1e-5):
    inputs = dict(x=(rng.standard_normal(shape) * 2 + 0.5).astype(dtype),
                  w=rng.standard_normal(shape[-1]).astype(dtype))
    return Case(inputs, lambda i: kl.rmsnorm_forward(i["x"], i["w"], eps),
                lambda d, c: dict(zip(("x", "w"), kl.rmsnorm_backward(d, c))), ("x", "w"))


def rope_case(rng, dtype, shape=(2, 3, 5, 4), theta=10000.0, per_row=False):
    B, _, S, hs = shape
    positions = rng.integers(0, 50, B) if per_row else np.arange(S)
    cos, sin = kl.rope_tables(positions, hs, theta, dtype)
    if per_row:                                       # decoding: one position per row, (B, 1, 1, hs)
        cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    inputs = dict(x=rng.standard_normal(shape).astype(dtype))
    return Case(inputs, lambda i: kl.rope_forward(i["x"], cos, sin),
                lambda d, c: dict(x=kl.rope_backward(d, c)), ("x",))


def swiglu_case(rng, dtype, shape=(2, 3, 4)):
    inputs = dict(gate=(rng.standard_normal(shape) * 3).astype(dtype), up=rng.standard_normal(shape).astype(dtype))
    return Case(inputs, lambda i: kl.swiglu_forward(i["gate"], i["up"]),
                lambda d, c: dict(zip(("gate", "up"), np.split(kl.swiglu_backward(d, c), 2, axis=-1))), ("gate", "up"))


def gqa_case(rng, dtype, B=2, H_kv=2, R=3, S=5, hs=3, mask=False):
    """Grouped-query attention: q (B, H_kv, R, S, hs) against k and v (B, H_kv, 1, S, hs), broadcast."""
    inputs = dict(q=rng.standard_normal((B, H_kv, R, S, hs)).astype(dtype),
                  k=rng.standard_normal((B, H_kv, 1, S, hs)).astype(dtype),
                  v=rng.standard_normal((B, H_kv, 1, S, hs)).astype(dtype))
    drop = rng.random((B, H_kv, R, S, S)) >= 0.3 if mask else None
    return Case(inputs, lambda i: kern.attention_forward(i["q"], i["k"], i["v"], drop, 1 / 0.7),
                lambda d, c: dict(zip(("q", "k", "v"), kern.attention_backward(d, c))), ("q", "k", "v"))


CASES = dict(rmsnorm=rmsnorm_case, rope=rope_case, swiglu=swiglu_case, gqa=gqa_case)
GRAD_CASES = [
    ("rmsnorm", dict(shape=(2, 5, 4))), ("rmsnorm", dict(shape=(1, 1, 3))),
    ("rmsnorm", dict(shape=(7, 2), eps=1e-3)),
    ("rope", dict(shape=(2, 3, 5, 4))), ("rope", dict(shape=(1, 1, 1, 2))),
    ("rope", dict(shape=(2, 2, 3, 8), theta=500.0)),
    ("rope", dict(shape=(3, 2, 1, 6), per_row=True)),
    ("swiglu", dict(shape=(2, 5, 4))), ("swiglu", dict(shape=(1,))), ("swiglu", dict(shape=(3, 1, 7))),
    ("gqa", dict()), ("gqa", dict(H_kv=1, R=4, S=3, hs=2)), ("gqa", dict(B=1, H_kv=3, R=1, S=4)), ("gqa", dict(mask=True)),
]


@pytest.mark.parametrize("seed,name,kw", [(s, n, kw) for s, (n, kw) in enumerate(GRAD_CASES)],
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in GRAD_CASES])
def test_backward_matches_finite_differences(seed, name, kw):
    rng = np.random.default_rng(seed)
    case = CASES[name](rng, np.float64, **kw)
    out, cache = case.forward(case.inputs)
    dout = rng.standard_normal(out.shape)            # L = sum(out * dout): dL/dout = dout
    grads = case.backward(dout, cache)
    for inp in case.wrt:
        assert grads[inp].shape == case.inputs[inp].shape, inp
        check(f"{name} d{inp}", grads[inp],
              numerical_grad(lambda: float(np.sum(case.forward(case.inputs)[0] * dout)), case.inputs[inp]), FD_TOL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_stays_float32_and_nothing_is_modified(name):
    rng = np.random.default_rng(5)
    case = CASES[name](rng, np.float32)
    before = {k: v.copy() for k, v in case.inputs.items()}
    out, cache = case.forward(case.inputs)
    assert out.dtype == np.float32
    grads = case.backward(rng.standard_normal(out.shape).astype(np.float32), cache)
    for k in case.wrt:
        assert grads[k].dtype == np.float32, k
        assert np.array_equal(case.inputs[k], before[k]), f"{name} modified its input {k}"


def test_rmsnorm_forward_matches_formula():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 4, 6)), rng.standard_normal(6)
    out, _ = kl.rmsnorm_forward(x, w, 1e-6)
    check("rmsnorm", out, x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6) * w, 1e-14)


def test_rope_pairs_the_two_halves_of_a_head():
    """Dimension j is rotated with j + hs/2 (the Hugging Face layout), at angle p / theta^(2j / hs)."""
    hs, theta, p = 6, 100.0, 7
    x = np.random.default_rng(2).standard_normal((1, 1, p + 1, hs))
    cos, sin = kl.rope_tables(np.arange(p + 1), hs, theta, np.float64)
    out, _ = kl.rope_forward(x, cos, sin)
    for j in range(hs // 2):
        a = p / theta ** (2 * j / hs)
        x1, x2 = x[0, 0, p, j], x[0, 0, p, j + hs // 2]
        check(f"pair {j}", out[0, 0, p, [j, j + hs // 2]],
              [x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], 1e-14)
    check("position 0 is the identity", out[0, 0, 0], x[0, 0, 0], 1e-15)
    # a rotation keeps lengths, and q'.k' depends on the positions' difference only
    for j in range(hs // 2):
        pair = [j, j + hs // 2]
        check(f"length of pair {j}", np.linalg.norm(out[..., pair], axis=-1), np.linalg.norm(x[..., pair], axis=-1),
              1e-14)
    q, k = np.random.default_rng(3).standard_normal((2, hs))
    dots = []
    for shift in (0, 3):
        c, s = kl.rope_tables(np.array([2 + shift, 5 + shift]), hs, theta, np.float64)
        rq, _ = kl.rope_forward(q, c[0], s[0])
        rk, _ = kl.rope_forward(k, c[1], s[1])
        dots.append(rq @ rk)
    check("relative positions", dots[0], dots[1], 1e-13)


def test_swiglu_forward_matches_formula():
    g, u = np.array([-800.0, -3.0, 0.0, 2.0, 800.0]), np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    with np.errstate(over="raise"):                 # no overflow in exp, however large |g|
        out, _ = kl.swiglu_forward(g, u)
    want = np.array([0.0, -3 / (1 + np.exp(3.0)) * 2, 0.0, 2 / (1 + np.exp(-2.0)) * 4, 800.0 * 5])
    check("swiglu", out, want, 1e-15)


def test_same_as_transformers_llama():
    """LlamaRMSNorm, LlamaRotaryEmbedding + apply_rotary_pos_emb and SiLU of transformers (float64)."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig
    rng = np.random.default_rng(4)
    B, H, S, hs = 2, 3, 7, 8
    x, w = rng.standard_normal((B, S, H * hs)), rng.standard_normal(H * hs)
    norm = llama.LlamaRMSNorm(H * hs, eps=1e-6).double()
    norm.weight.data = torch.tensor(w)
    # LlamaRMSNorm normalises in float32 whatever the input: agreement to float32's rounding
    check("RMSNorm", kl.rmsnorm_forward(x, w, 1e-6)[0], norm(torch.tensor(x)).detach().numpy(), 1e-6)
    cfg = LlamaConfig(hidden_size=H * hs, num_attention_heads=H, rope_theta=500.0, max_position_embeddings=64)
    rotary = llama.LlamaRotaryEmbedding(cfg).double()
    q, k = rng.standard_normal((2, B, H, S, hs))
    pos = torch.arange(S)[None].expand(B, S)
    cos_t, sin_t = rotary(torch.tensor(q), pos)
    q_t, k_t = llama.apply_rotary_pos_emb(torch.tensor(q), torch.tensor(k), cos_t, sin_t)
    cos, sin = kl.rope_tables(np.arange(S), hs, 500.0, np.float64)
    # transformers computes its angles in float32: agreement to float32's rounding of the angle
    check("RoPE q", kl.rope_forward(q, cos, sin)[0], q_t.numpy(), 1e-5)
    check("RoPE k", kl.rope_forward(k, cos, sin)[0], k_t.numpy(), 1e-5)
    g, u = rng.standard_normal((2, 4, 5)) * 3
    want = (torch.nn.functional.silu(torch.tensor(g)) * torch.tensor(u)).numpy()
    check("SwiGLU", kl.swiglu_forward(g, u)[0], want, 1e-14)
