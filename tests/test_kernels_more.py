"""mpi_tp.core.kernels beyond their values: dtypes, purity, and independent references when installed.

    .venv/bin/python -m pytest -q tests/test_kernels_more.py

On the cases of tests/test_kernels.py: float32 in gives float32 out and float32
gradients; no input or cache is modified and every gradient is a fresh array;
attention dropout's bool mask and scale in closed form; PyTorch autograd (float64, when torch is installed) and CuPy (when a GPU is)
give the same outputs and gradients. No MPI.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_kernels import CASES, DROP_SCALE, GRAD_CASES, check

from mpi_tp.core import kernels as kern

# ------------------------------------------------------------ dtype and purity, every kernel

ALL_KERNELS = [("linear", {}), ("linear", dict(bias=False)), ("layernorm", {}), ("gelu", {}),
               ("attention", {}), ("attention", dict(mask="full")), ("embedding", {}),
               ("cross_entropy", {})]
ALL_IDS = [n + ("-" + "-".join(map(str, kw.values())) if kw else "") for n, kw in ALL_KERNELS]


def run_case(case, rng):
    out, cache = case.forward(case.inputs)
    G = 1.0 if np.ndim(out) == 0 else rng.standard_normal(out.shape).astype(out.dtype)
    return out, cache, G


@pytest.mark.parametrize("name,kw", ALL_KERNELS, ids=ALL_IDS)
def test_float32_stays_float32(name, kw):
    rng = np.random.default_rng(200)
    case32 = CASES[name](rng, np.float32, **kw)
    if name == "attention" and case32.inputs["drop_mask"] is not None:     # a float64 scale must not upcast
        case32 = case32._replace(forward=lambda i: kern.attention_forward(i["q"], i["k"], i["v"], i["drop_mask"],
                                                                          np.float64(DROP_SCALE)))
    out, cache, G = run_case(case32, rng)
    if np.ndim(out) == 0:
        assert isinstance(out, float)
        G = np.float64(1.0)  # a float64 scalar dloss must not upcast either
    else:
        assert out.dtype == np.float32, out.dtype
    grads = case32.backward(G, cache)
    for inp in case32.wrt:
        assert grads[inp].dtype == np.float32, (inp, grads[inp].dtype)
    # and the float32 numbers are the float64 ones, rounded
    inputs64 = {n: (a.astype(np.float64) if a is not None and a.dtype == np.float32 else a)
                for n, a in case32.inputs.items()}
    out64, cache64 = case32.forward(inputs64)
    grads64 = case32.backward(np.asarray(G, dtype=np.float64), cache64)
    check(f"{name} out float32", out, out64, 1e-5)
    for inp in case32.wrt:
        check(f"{name} d{inp} float32", grads[inp], grads64[inp], 1e-5)


@pytest.mark.parametrize("name,kw", ALL_KERNELS, ids=ALL_IDS)
def test_kernels_are_pure_and_grads_fresh(name, kw):
    rng = np.random.default_rng(201)
    case = CASES[name](rng, np.float64, **kw)
    before = {n: None if a is None else a.copy() for n, a in case.inputs.items()}
    out, cache, G = run_case(case, rng)
    G_before = np.copy(G)
    first = case.backward(G, cache)
    first_values = {n: g.copy() for n, g in first.items() if g is not None}
    second = case.backward(G, cache)  # the cache survives a backward: nothing accumulated
    for n, a in case.inputs.items():
        if a is not None:
            np.testing.assert_array_equal(a, before[n], err_msg=f"{name} modified input {n}")
    np.testing.assert_array_equal(G, G_before, err_msg=f"{name} modified dout")
    for inp in case.wrt:
        np.testing.assert_array_equal(first_values[inp], second[inp], err_msg=f"{name} d{inp}")
        assert not np.shares_memory(first[inp], second[inp]), f"{name} d{inp} reuses a buffer"
        others = [G, *[a for a in case.inputs.values() if a is not None]]
        assert not any(np.shares_memory(first[inp], o) for o in others if isinstance(o, np.ndarray))


# ------------------------------------------------------------ attention dropout: mask and scale

def test_attention_dropout_keeps_and_scales():
    """A mask that keeps everything scales out and gradients by drop_scale; one that drops every
    key but the first leaves drop_scale * probs[query, 0] * v[0] at every query."""
    rng = np.random.default_rng(104)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    G = rng.standard_normal((2, 3, 5, 4))
    out, cache = kern.attention_forward(q, k, v)
    out_s, cache_s = kern.attention_forward(q, k, v, np.ones((5, 5), dtype=bool), 2.5)
    np.testing.assert_allclose(out_s, 2.5 * out, rtol=1e-14)
    for g, g_s in zip(kern.attention_backward(G, cache), kern.attention_backward(G, cache_s)):
        np.testing.assert_allclose(g_s, 2.5 * g, rtol=1e-12, atol=1e-15)
    first = np.zeros((5, 5), dtype=bool)
    first[:, 0] = True
    out_f, _ = kern.attention_forward(q, k, v, first, 1.25)
    probs0 = np.exp(attention_logits(q, k))[..., 0] / np.exp(attention_logits(q, k)).sum(-1)
    np.testing.assert_allclose(out_f, 1.25 * probs0[..., None] * v[:, :, :1], rtol=1e-12)


def attention_logits(q, k):
    """Causal scores q k^T / sqrt(hs), -inf above the diagonal."""
    S, hs = q.shape[-2:]
    return np.where(np.tri(S, dtype=bool), q @ k.swapaxes(-1, -2) / math.sqrt(hs), -np.inf)



# ------------------------------------------------------------ other implementations, when installed

def test_against_torch_autograd():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(300)

    def torch_attention(q, k, v, drop_mask):
        T, D = q.shape[-2:]
        att = q @ k.transpose(-1, -2) / math.sqrt(D)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(att, dim=-1)
        return p @ v if drop_mask is None else (p * drop_mask) @ v * DROP_SCALE

    refs = {
        "linear": lambda i: F.linear(i["x"], i["w"].T, i["b"]),
        "layernorm": lambda i, eps=1e-5: F.layer_norm(i["x"], i["w"].shape, i["w"], i["b"], eps=eps),
        "gelu": lambda i: F.gelu(i["x"], approximate="tanh"),
        "attention": lambda i: torch_attention(i["q"], i["k"], i["v"], i["drop_mask"]),
        "embedding": lambda i: F.embedding(i["ids"], i["table"]),
        "cross_entropy": lambda i: F.cross_entropy(i["logits"].reshape(-1, i["logits"].shape[-1]),
                                                   i["targets"].reshape(-1)),
    }
    for name, kw in GRAD_CASES:
        case = CASES[name](rng, np.float64, **kw)
        out, cache = case.forward(case.inputs)
        G = 1.0 if np.ndim(out) == 0 else rng.standard_normal(out.shape)
        grads = case.backward(G, cache)
        t_in = {n: None if a is None else torch.tensor(a, requires_grad=n in case.wrt)
                for n, a in case.inputs.items()}
        t_out = refs[name](t_in, **{k: v for k, v in kw.items() if k == "eps"})    # the case's own epsilon
        (t_out * torch.as_tensor(G)).sum().backward()
        check(f"torch {name} out", out, t_out.detach().numpy(), 1e-12)
        for inp in case.wrt:
            check(f"torch {name} d{inp}", grads[inp], t_in[inp].grad.numpy(), 1e-10)


def test_cupy_matches_numpy(monkeypatch):
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("CuPy sees no GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("CuPy has no working GPU")
    from mpi_tp.core import backend
    monkeypatch.setattr(backend, "_xp", cupy)  # what backend.use("cupy") sets, undone after the test
    monkeypatch.setattr(backend, "_name", "cupy")
    rng = np.random.default_rng(400)
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-4)):
        for name, kw in ALL_KERNELS:
            case = CASES[name](rng, dtype, **kw)
            out, cache, G = run_case(case, rng)
            grads = case.backward(G, cache)
            gpu_in = {n: None if a is None else cupy.asarray(a) for n, a in case.inputs.items()}
            g_out, g_cache = case.forward(gpu_in)
            g_grads = case.backward(G if np.ndim(out) == 0 else cupy.asarray(G), g_cache)
            if np.ndim(out) == 0:
                assert isinstance(g_out, float)
            else:
                assert isinstance(g_out, cupy.ndarray) and g_out.dtype == dtype
            check(f"cupy {name} out", cupy.asnumpy(g_out) if np.ndim(out) else g_out, out, tol)
            for inp in case.wrt:
                assert g_grads[inp].dtype == dtype
                check(f"cupy {name} d{inp}", cupy.asnumpy(g_grads[inp]), grads[inp], tol)
