"""The block-by-block optimizers against textbook whole-array updates, and the schedule."""
import math

import numpy as np
import pytest

from mpi_tp.core.params import fuse_last_axis, make_param
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import BLOCK, SGD, AdamW, clip_coefficient, grad_norm, lr_at


def params(seed=0):
    """A matrix (decayed, larger than one block), a fused pair of views, and a bias."""
    rng = np.random.default_rng(seed)
    w = make_param("w", (300, BLOCK // 100), "float64", decay=True)
    a = make_param("q", (7, 3), "float64", decay=True)
    b = make_param("k", (7, 4), "float64", decay=True)
    fuse_last_axis([a, b])
    bias = make_param("b", (5,), "float64")
    ps = [w, a, b, bias]
    for p in ps:
        p.data[...] = rng.standard_normal(p.data.shape)
    return ps


def set_grads(ps, step):
    rng = np.random.default_rng(100 + step)
    for p in ps:
        p.grad[...] = rng.standard_normal(p.grad.shape)


def test_adamw_matches_the_textbook_update():
    ps, ref = params(), params()
    opt = AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m = [np.zeros_like(p.data) for p in ref]
    v = [np.zeros_like(p.data) for p in ref]
    for t in range(1, 6):
        set_grads(ps, t), set_grads(ref, t)
        lr = 1e-2 * t / 5
        scale = 0.5 if t == 3 else 1.0                       # one clipped step
        opt.step(lr, grad_scale=scale)
        for i, p in enumerate(ref):                          # Loshchilov & Hutter, decoupled decay
            g = p.grad * scale
            if p.decay:
                p.data *= 1 - lr * 0.1
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.95 * v[i] + 0.05 * g * g
            mhat, vhat = m[i] / (1 - 0.9 ** t), v[i] / (1 - 0.95 ** t)
            p.data -= lr * mhat / (np.sqrt(vhat) + 1e-8)
    for p, q in zip(ps, ref):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-14, err_msg=p.name)
    state = opt.state_tensors()
    for i, p in enumerate(ps):
        np.testing.assert_allclose(state["m"][i], m[i], rtol=1e-12, atol=1e-15, err_msg=p.name)


def test_sgd_matches_the_textbook_update():
    ps, ref = params(1), params(1)
    opt = SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)
    buf = [np.zeros_like(p.data) for p in ref]
    for t in range(1, 5):
        set_grads(ps, t), set_grads(ref, t)
        opt.step()
        for i, p in enumerate(ref):
            g = p.grad + (0.01 * p.data if p.decay else 0)
            buf[i] = 0.9 * buf[i] + g
            p.data -= 0.1 * buf[i]
    for p, q in zip(ps, ref):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-12, atol=1e-14, err_msg=p.name)


def test_schedule_and_clipping():
    assert lr_at(0, 1.0, 10, 100) == pytest.approx(0.1)                  # warm-up starts at lr / warmup
    assert lr_at(9, 1.0, 10, 100) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 10, 100) == pytest.approx(1.0)                 # cosine from the top
    assert lr_at(55, 1.0, 10, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)                # ends at min_ratio * lr
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(4.0, 1.0) == pytest.approx(0.25, rel=1e-6)
    assert clip_coefficient(4.0, 0.0) == 1.0                             # 0: no clipping


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_fused_adamw_update_gives_the_blocked_loops_numbers(dtype, monkeypatch):
    """Issue 21, finding 7: on CuPy AdamW runs one fused elementwise function per segment (cupy.fuse)
    instead of a dozen passes; in the blocked loop's order of operations, so bitwise the same numbers."""
    from mpi_tp.core import backend
    from mpi_tp.core.params import make_param
    from mpi_tp.training import optim as optim_module
    results = []
    for path in ("numpy", "cupy"):
        params = [make_param("w", (300, 7), dtype, seed=1, decay=True), make_param("b", (7,), dtype, seed=2)]
        for p in params:
            p.grad[...] = np.random.default_rng(3).standard_normal(p.grad.shape)
        opt = AdamW(params, lr=1e-2)
        monkeypatch.setattr(optim_module.backend, "name", lambda path=path: path)
        for _ in range(3):
            opt.step(grad_scale=0.7)
        monkeypatch.setattr(optim_module.backend, "name", backend.name)
        results.append([p.data.copy() for p in params] + [a.copy() for k in ("m", "v") for a in opt.state[k]])
    assert all(np.array_equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_norm_of_16_bit_gradients_is_summed_in_fp32(dtype):
    """fp16's dot product sums in fp16 and overflows past 65504 (these squares add to 2.7e5): the norm
    squares and sums 16-bit gradients in fp32 (then float64 across storages), as the fp32 norm would."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a requirement: pip install -e .")
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    params = [make_param(f"p{i}", (30000,), dt, seed=i) for i in range(2)]
    rng = np.random.default_rng(0)
    for p in params:
        p.grad[...] = (rng.standard_normal(30000) * 3).astype(np.float32).astype(dt)
    want = np.sqrt(sum(float((p.grad.astype(np.float64) ** 2).sum()) for p in params))
    assert grad_norm(params, Topology.serial().tp) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("opt_cls,opts", [(AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                          (SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01))])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_parameters_are_updated_through_fp32_masters(opt_cls, opts, dtype):
    """The update of 16-bit parameters is the fp32 optimizer's on fp32 masters, bit for bit (the same fp32
    arithmetic on the same widened gradients), and the parameters are the masters rounded once; the
    moments and masters are fp32 state, saved and loaded like the moments."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a requirement: pip install -e .")
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    half = [make_param("w", (50, 3), dt, seed=1, decay=True), make_param("b", (7,), dt, seed=2)]
    wide = [make_param(p.name, p.data.shape, np.float32, decay=p.name == "w") for p in half]
    for p, q in zip(half, wide):
        q.data[...] = p.data.astype(np.float32)                 # the same starting values
    opt, ref = opt_cls(half, **opts), opt_cls(wide, **opts)
    assert opt.masters and not ref.masters and all(a.dtype == np.float32 for k in opt.state for a in opt.state[k])
    rng = np.random.default_rng(0)
    for step in range(3):
        for p, q in zip(half, wide):
            p.grad[...] = rng.standard_normal(p.grad.shape).astype(np.float32).astype(dt)
            q.grad[...] = p.grad.astype(np.float32)
        opt.step(grad_scale=0.5)
        ref.step(grad_scale=0.5)
        for p, q, master in zip(half, wide, opt.state_tensors()["master"]):
            assert np.array_equal(master, q.data), f"{p.name}: the masters are the fp32 run"
            assert p.data.dtype == dt and np.array_equal(p.data, q.data.astype(dt)), f"{p.name}: rounded once"
    again = opt_cls([make_param(p.name, p.data.shape, dt, decay=p.name == "w") for p in half], **opts)
    again.load_state_tensors(opt.state_tensors())
    assert all(np.array_equal(a, b) for k in opt.state for a, b in zip(again.state[k], opt.state[k]))
