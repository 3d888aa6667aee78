"""Tests for mpi_tp.core.kernels, the pure forward/backward pairs.

    .venv/bin/python -m pytest -q tests/test_kernels.py

Each backward is checked against central finite differences in float64 (every
input element, small shapes), each forward against a naive reference written
independently here. tests/test_kernels_more.py adds dtype preservation, purity
(no input or cache is modified, grads are fresh) and, when installed, PyTorch
autograd and CuPy, on the same cases.
No MPI: under `mpiexec -n 2 python -m pytest --with-mpi` every rank runs them alone.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import numpy as np
import pytest

from mpi_tp.core import kernels as kern

FD_EPS = 1e-6
FD_TOL = 1e-6


def rel_error(a, b) -> float:
    """max|a - b| / max(max|a|, max|b|, tiny)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    scale = max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0), 1e-300)
    return float(np.abs(a - b).max(initial=0.0) / scale)


def check(name, got, want, tol):
    err = rel_error(got, want)
    assert err < tol, f"{name}: relative error {err:.3e} (tolerance {tol:.0e})"


def numerical_grad(f: Callable[[], float], x: np.ndarray, eps: float = FD_EPS) -> np.ndarray:
    """Central differences of the scalar f() with respect to every element of x (perturbed in place)."""
    assert x.flags.c_contiguous
    flat = x.reshape(-1)  # a view: writing it perturbs x
    grad = np.zeros(x.size)
    for i in range(x.size):
        old = flat[i]
        flat[i] = old + eps
        f_plus = f()
        flat[i] = old - eps
        f_minus = f()
        flat[i] = old
        grad[i] = (f_plus - f_minus) / (2 * eps)
    return grad.reshape(x.shape)


# ------------------------------------------------------------ one case per kernel

class Case(NamedTuple):
    inputs: dict                 # name -> array (or None)
    forward: Callable            # inputs -> (out, cache)
    backward: Callable           # (dout, cache) -> {input name: grad}
    wrt: tuple                   # inputs that get a gradient


def linear_case(rng, dtype, lead=(2, 3), k=4, m=5, bias=True):
    inputs = dict(x=rng.standard_normal((*lead, k)).astype(dtype),
                  w=rng.standard_normal((k, m)).astype(dtype),
                  b=rng.standard_normal(m).astype(dtype) if bias else None)

    def backward(dout, cache):
        dx, dw, db = kern.linear_backward(dout, cache)
        return dict(x=dx, w=dw, b=db) if bias else dict(x=dx, w=dw)
    return Case(inputs, lambda i: kern.linear_forward(i["x"], i["w"], i["b"]), backward,
                ("x", "w", "b") if bias else ("x", "w"))


def layernorm_case(rng, dtype, shape=(2, 3, 4), eps=1e-5):
    c = shape[-1]
    inputs = dict(x=(rng.standard_normal(shape) * 2 + 0.5).astype(dtype),
                  w=rng.standard_normal(c).astype(dtype),
                  b=rng.standard_normal(c).astype(dtype))
    return Case(inputs, lambda i: kern.layernorm_forward(i["x"], i["w"], i["b"], eps=eps),
                lambda d, c_: dict(zip(("x", "w", "b"), kern.layernorm_backward(d, c_))),
                ("x", "w", "b"))


def gelu_case(rng, dtype, shape=(2, 3, 4)):
    inputs = dict(x=(rng.standard_normal(shape) * 2).astype(dtype))
    return Case(inputs, lambda i: kern.gelu_forward(i["x"]),
                lambda d, c: dict(x=kern.gelu_backward(d, c)), ("x",))


P_DROP = 0.3                     # the attention cases' dropout probability
DROP_SCALE = 1.0 / (1.0 - P_DROP)


def make_drop_mask(rng, shape, p=P_DROP):
    """Attention dropout's keep mask: bool, True (kept) with probability 1 - p."""
    return rng.random(shape) >= p


def attention_case(rng, dtype, shape=(2, 2, 5, 3), mask=None):
    b, h, t, d = shape
    mask_shape = {None: None, "full": (b, h, t, t), "broadcast": (1, h, t, t), "2d": (t, t)}[mask]
    inputs = dict(q=rng.standard_normal(shape).astype(dtype),
                  k=rng.standard_normal(shape).astype(dtype),
                  v=rng.standard_normal(shape).astype(dtype),
                  drop_mask=None if mask is None else make_drop_mask(rng, mask_shape))
    return Case(inputs, lambda i: kern.attention_forward(i["q"], i["k"], i["v"], i["drop_mask"], DROP_SCALE),
                lambda d_, c: dict(zip(("q", "k", "v"), kern.attention_backward(d_, c))),
                ("q", "k", "v"))


def embedding_case(rng, dtype, ids_shape=(2, 5), vocab=4, c=3):
    inputs = dict(ids=rng.integers(0, vocab, size=ids_shape),
                  table=rng.standard_normal((vocab, c)).astype(dtype))
    return Case(inputs, lambda i: kern.embedding_forward(i["ids"], i["table"]),
                lambda d, c_: dict(table=kern.embedding_backward(d, c_)), ("table",))


def cross_entropy_case(rng, dtype, lead=(2, 5), vocab=7):
    inputs = dict(logits=(rng.standard_normal((*lead, vocab)) * 3).astype(dtype),
                  targets=rng.integers(0, vocab, size=lead))
    return Case(inputs, lambda i: kern.cross_entropy_forward(i["logits"], i["targets"]),
                lambda d, c: dict(logits=kern.cross_entropy_backward(d, c)), ("logits",))


CASES = dict(linear=linear_case, layernorm=layernorm_case, gelu=gelu_case,
             attention=attention_case, embedding=embedding_case, cross_entropy=cross_entropy_case)

GRAD_CASES = [
    ("linear", dict(lead=(3,), k=4, m=5)),
    ("linear", dict(lead=(2, 5), k=3, m=2)),
    ("linear", dict(lead=(1, 1), k=1, m=1)),
    ("linear", dict(lead=(2, 3, 1), k=2, m=3, bias=False)),
    ("layernorm", dict(shape=(2, 5, 4))),
    ("layernorm", dict(shape=(1, 1, 3))),
    ("layernorm", dict(shape=(7, 2), eps=1e-3)),
    ("gelu", dict(shape=(2, 5, 4))),
    ("gelu", dict(shape=(1,))),
    ("gelu", dict(shape=(3, 1, 7))),
    ("attention", dict(shape=(1, 1, 1, 1))),
    ("attention", dict(shape=(2, 2, 5, 3))),
    ("attention", dict(shape=(1, 3, 4, 8))),
    ("attention", dict(shape=(2, 1, 7, 2))),
    ("attention", dict(shape=(2, 2, 5, 3), mask="full")),
    ("attention", dict(shape=(1, 3, 4, 2), mask="broadcast")),
    ("attention", dict(shape=(2, 1, 6, 3), mask="2d")),
    ("attention", dict(shape=(1, 1, 1, 3), mask="full")),
    ("embedding", dict(ids_shape=(2, 5), vocab=4, c=3)),
    ("embedding", dict(ids_shape=(7,), vocab=9, c=1)),
    ("embedding", dict(ids_shape=(2, 1, 3), vocab=2, c=5)),
    ("cross_entropy", dict(lead=(2, 5), vocab=7)),
    ("cross_entropy", dict(lead=(3,), vocab=4)),
    ("cross_entropy", dict(lead=(1, 1), vocab=1)),
    ("cross_entropy", dict(lead=(2, 1, 3), vocab=5)),
]
GRAD_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in GRAD_CASES]


@pytest.mark.parametrize("seed,name,kw", [(s, n, kw) for s, (n, kw) in enumerate(GRAD_CASES)],
                         ids=GRAD_IDS)
def test_backward_matches_finite_differences(seed, name, kw):
    rng = np.random.default_rng(seed)
    case = CASES[name](rng, np.float64, **kw)
    out, cache = case.forward(case.inputs)
    # L = sum(out * G) for a fixed random G, so dL/dout = G
    G = float(rng.standard_normal()) if np.ndim(out) == 0 else rng.standard_normal(out.shape)
    grads = case.backward(G, cache)

    def loss():
        return float(np.sum(case.forward(case.inputs)[0] * G))
    for inp in case.wrt:
        assert grads[inp].shape == case.inputs[inp].shape, inp
        check(f"{name} d{inp}", grads[inp], numerical_grad(loss, case.inputs[inp]), FD_TOL)


# ------------------------------------------------------------ forward references

def test_linear_forward_matches_loops():
    rng = np.random.default_rng(100)
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    out, _ = kern.linear_forward(x, w, b)
    want = np.zeros((2, 3, 5))
    for i, j, m in np.ndindex(*want.shape):
        want[i, j, m] = sum(x[i, j, k] * w[k, m] for k in range(4)) + b[m]
    check("linear out", out, want, 1e-12)
    out_nobias, cache = kern.linear_forward(x, w)
    check("linear out without bias", out_nobias, want - b, 1e-12)
    assert kern.linear_backward(np.ones_like(out), cache)[2] is None


@pytest.mark.parametrize("rows", [0, 1, 2, 4, 8, kern.FEW_ROWS, kern.FEW_ROWS + 1])
def test_linear_forward_with_the_weight_stored_out_in(rows):
    """A weight stored (out, in) (w = w_t.T, a decoder's) gives x @ w + b whether the few-row form computes it
    (in panels of weight rows: K 2048 makes 3 panels of 300 rows at 4 rows, 1 at 8) or the plain GEMM does,
    C-ordered; the (in, out) weight's result is the reference."""
    rng = np.random.default_rng(rows)
    x, w, b = rng.standard_normal((rows, 1, 2048)), rng.standard_normal((2048, 300)), rng.standard_normal(300)
    stored = np.ascontiguousarray(w.T).T
    assert not stored.flags.c_contiguous and stored.T.flags.c_contiguous
    want, _ = kern.linear_forward(x, w, b)
    out, (_, w_cached, _) = kern.linear_forward(x, stored, b)
    assert out.flags.c_contiguous and out.shape == (rows, 1, 300) and w_cached is stored
    check("x @ w_t.T + b", out, want, 1e-12)
    check("and its backward", kern.linear_backward_input(out, stored), kern.linear_backward_input(out, w), 1e-12)


def test_layernorm_forward_matches_per_row_statistics():
    rng = np.random.default_rng(101)
    x = rng.standard_normal((3, 4, 6)) * 5 + 2
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    out, _ = kern.layernorm_forward(x, w, b, eps=1e-5)
    want = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        row = [float(v) for v in x[idx]]
        mu = sum(row) / len(row)
        var = sum((v - mu) ** 2 for v in row) / len(row)  # biased
        want[idx] = [(v - mu) / math.sqrt(var + 1e-5) * wi + bi for v, wi, bi in zip(row, w, b)]
    check("layernorm out", out, want, 1e-12)


def test_gelu_forward_matches_formula():
    x = np.linspace(-6, 6, 49)
    out, _ = kern.gelu_forward(x)
    want = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in x]
    check("gelu out", out, want, 1e-14)
    assert kern.gelu_forward(np.array([0.0]))[0][0] == 0.0
    np.testing.assert_allclose(kern.gelu_forward(np.array([1.0]))[0], [0.8411919906082768], rtol=1e-12)


def attention_reference(q, k, v, drop_mask=None, drop_scale=DROP_SCALE):
    """One query at a time: scores against keys 0..t only, softmax, dropout, weighted sum."""
    B, H, T, D = q.shape
    mask = np.ones((B, H, T, T)) if drop_mask is None else np.broadcast_to(drop_mask * drop_scale, (B, H, T, T))
    out = np.zeros_like(q)
    for b, h, t in np.ndindex(B, H, T):
        scores = np.array([np.dot(q[b, h, t], k[b, h, s]) / math.sqrt(D) for s in range(t + 1)])
        p = np.exp(scores - scores.max())
        p /= p.sum()
        p *= mask[b, h, t, :t + 1]
        out[b, h, t] = sum(p[s] * v[b, h, s] for s in range(t + 1))
    return out


@pytest.mark.parametrize("shape,mask", [((2, 3, 5, 4), None), ((1, 2, 6, 3), "full"),
                                        ((2, 2, 4, 2), "broadcast"), ((1, 1, 1, 5), None)])
def test_attention_forward_matches_loops(shape, mask):
    case = attention_case(np.random.default_rng(102), np.float64, shape=shape, mask=mask)
    i = case.inputs
    out, _ = case.forward(i)
    check("attention out", out, attention_reference(i["q"], i["k"], i["v"], i["drop_mask"]), 1e-12)


def test_attention_is_causal_and_stable():
    rng = np.random.default_rng(103)
    q, k, v = (rng.standard_normal((2, 2, 6, 4)) for _ in range(3))
    out, _ = kern.attention_forward(q * 1e3, k, v)  # huge scores: a naive softmax would overflow
    assert np.isfinite(out).all()
    out, _ = kern.attention_forward(q, k, v)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 4:] += 10.0  # change the future of positions 0..3
    v2[:, :, 4:] -= 7.0
    out2, _ = kern.attention_forward(q, k2, v2)
    np.testing.assert_array_equal(out[:, :, :4], out2[:, :, :4])
    assert not np.allclose(out[:, :, 4:], out2[:, :, 4:])


def test_embedding_forward_and_repeated_ids_sum():
    table = np.arange(12.0).reshape(4, 3)
    ids = np.array([[1, 1, 1], [0, 1, 3]])
    out, cache = kern.embedding_forward(ids, table)
    for bi, ti in np.ndindex(*ids.shape):
        np.testing.assert_array_equal(out[bi, ti], table[ids[bi, ti]])
    dout = np.arange(18.0).reshape(2, 3, 3)
    dtable = kern.embedding_backward(dout, cache)
    want = np.zeros((4, 3))
    want[1] = dout[0, 0] + dout[0, 1] + dout[0, 2] + dout[1, 1]
    want[0] = dout[1, 0]
    want[3] = dout[1, 2]  # row 2 is never used: stays zero
    np.testing.assert_array_equal(dtable, want)


def test_cross_entropy_forward_matches_explicit_softmax():
    rng = np.random.default_rng(104)
    logits, targets = rng.standard_normal((3, 4, 6)), rng.integers(0, 6, size=(3, 4))
    loss, _ = kern.cross_entropy_forward(logits, targets)
    assert isinstance(loss, float)
    probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    want = -np.mean([np.log(probs[i, j, targets[i, j]]) for i, j in np.ndindex(3, 4)])
    assert abs(loss - want) < 1e-12 * abs(want)
    # shifting every logit changes nothing and stays finite far beyond exp's range
    shifted, _ = kern.cross_entropy_forward(logits + 1000.0, targets)
    assert abs(shifted - want) < 1e-9 * abs(want)
    # a target with probability below float64's smallest number still gives a finite loss
    extreme = np.array([[0.0, 2000.0]])
    assert kern.cross_entropy_forward(extreme, np.array([0]))[0] == pytest.approx(2000.0)


def test_cross_entropy_backward_closed_form():
    rng = np.random.default_rng(105)
    logits, targets = rng.standard_normal((5, 3)), rng.integers(0, 3, size=5)
    _, cache = kern.cross_entropy_forward(logits, targets)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    want = 2.5 * (probs - np.eye(3)[targets]) / 5
    check("dlogits", kern.cross_entropy_backward(2.5, cache), want, 1e-12)
