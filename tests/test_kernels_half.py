"""The kernels on 16-bit storage (mpi_tp.core.kernels_half) through mpi_tp.core.kernels: products
accumulated in fp32 and rounded once to the inputs' format; the fp32-computed pairs (norms, GELU, SwiGLU,
attention) keeping the fp32 kernel's cache at 16 bits.

References. The definition: the fp32 kernel on the widened inputs (exact: every 16-bit value is an fp32
value), rounded once with ml_dtypes / NumPy's float16 casts, must equal ours bit for bit: every forward
output, and the linear kernels' gradients (their cache is the inputs themselves). PyTorch's bf16 and
fp16 layers on the CPU (fp32 accumulation too, in oneDNN's order): an fp32 sum in another order differs
by a few fp32 ulps, which can move the rounded result by one 16-bit ulp, so they must agree within one
ulp of the format: |ours - torch| <= 2^-7 |torch| for bf16 (8 significant bits), 2^-10 |torch| for fp16
(11), plus the format's smallest normal for results near zero.

The backward of a kernel that keeps an activation (LayerNorm's normalised input, GELU's tanh, SwiGLU's
sigmoid and silu, the softmax output, the online softmax's output) reads it rounded to 16 bits, as
Megatron's does: each kept value is off by at most u = 2^-8 (bf16) or 2^-11 (fp16) of itself, and
backward_bounds / attention_bounds carry that through each gradient's formula to first order (a bound
B per element, from the fp32 cache in float64). So against the fp32 pair's gradients g,
|ours - g| <= u |g| + B (+ fp32 noise, `within`), and against PyTorch's, which recompute from the 16-bit
input, one ulp plus B. B is what the bytes cost: with it 8-31% of bf16 gradients sit beyond the one
rounding; without the kept arrays' rounding (the old recomputing cache) they were the fp32 pair's bits.
"""
import numpy as np
import pytest

from mpi_tp.core import kernels as kern
from mpi_tp.core.precision import is_half

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is a requirement: pip install -e .")
FORMATS = {"bf16": (np.dtype(ml_dtypes.bfloat16), 2.0 ** -7, 1.18e-38), "fp16": (np.dtype(np.float16), 2.0 ** -10,
                                                                                    6.11e-5)}


def operands(fmt, N=24, K=40, O=33, seed=0):
    dtype = FORMATS[fmt][0]
    rng = np.random.default_rng(seed)
    x, w, b, dout = (rng.standard_normal(s).astype(np.float32).astype(dtype)
                     for s in ((2, N // 2, K), (K, O), (O,), (2, N // 2, O)))
    return x, w, b, dout


def f32(a):
    return a.astype(np.float32)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rounded_once_from_the_fp32_kernel(fmt):
    dtype = FORMATS[fmt][0]
    x, w, b, dout = operands(fmt)
    out, cache = kern.linear_forward(x, w, b)
    ref, _ = kern.linear_forward(f32(x), f32(w), f32(b))
    assert out.dtype == dtype and np.array_equal(f32(out), f32(ref.astype(dtype)))
    assert cache[0] is x and cache[0].itemsize == 2                  # the backward keeps the 16-bit input
    dx, dw, db = kern.linear_backward(dout, cache)
    rdx, rdw, rdb = kern.linear_backward(f32(dout), (f32(x), f32(w), True))
    for name, got, want in (("dx", dx, rdx), ("dw", dw, rdw), ("db", db, rdb)):
        assert got.dtype == dtype and np.array_equal(f32(got), f32(want.astype(dtype))), name


def test_fp32_gradient_buffers_keep_the_sum_unrounded():
    """Megatron's accumulate-in-fp32: dw written into an fp32 buffer is the fp32 sum, not its rounding."""
    x, w, _, dout = operands("bf16")
    buf = np.zeros(w.shape, dtype=np.float32)
    dw, db = kern.linear_backward_weight(dout, x, True, dw_out=buf)
    want, want_db = kern.linear_backward_weight(f32(dout), f32(x), True)
    assert dw is buf and np.array_equal(buf, want) and db.dtype == np.float32 and np.array_equal(db, want_db)
    assert not np.array_equal(buf, f32(buf.astype(ml_dtypes.bfloat16)))       # some bits below bf16's


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_within_one_ulp_of_pytorch(fmt):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle (the hf-oracle extra)")
    _, ulp, tiny = FORMATS[fmt]
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    x, w, b, dout = operands(fmt, N=64, K=256, O=96, seed=1)
    tx, tw, tb = (torch.from_numpy(f32(a)).to(tdtype).requires_grad_() for a in (x, w, b))
    ty = torch.nn.functional.linear(tx, tw.T, tb)                    # our w is (in, out): PyTorch's is (out, in)
    ty.backward(torch.from_numpy(f32(dout)).to(tdtype))
    out, cache = kern.linear_forward(x, w, b)
    dx, dw, db = kern.linear_backward(dout, cache)
    for name, ours, theirs in (("out", out, ty), ("dx", dx, tx.grad), ("dw", dw, tw.grad), ("db", db, tb.grad)):
        t = theirs.detach().float().numpy()
        assert np.all(np.abs(f32(ours) - t) <= ulp * np.abs(t) + tiny), f"{fmt} {name}"


def test_only_16_bit_arrays_take_this_path():
    assert is_half(np.zeros(2, np.float16)) and is_half(np.zeros(2, ml_dtypes.bfloat16))
    assert not any(is_half(np.zeros(2, d)) for d in (np.float32, np.float64, np.int16, np.uint16))


def _pairs():
    from mpi_tp.core import kernels_llama as kl
    C = 48
    return {   # name: (forward, backward, input shapes, options)
        "layernorm": (kern.layernorm_forward, kern.layernorm_backward, [(2, 7, C), (C,), (C,)], {"eps": 1e-5}),
        "rmsnorm": (kl.rmsnorm_forward, kl.rmsnorm_backward, [(2, 7, C), (C,)], {"eps": 1e-5}),
        "gelu": (kern.gelu_forward, kern.gelu_backward, [(2, 7, C)], {}),
        "swiglu": (kl.swiglu_forward, kl.swiglu_backward, [(2, 7, C), (2, 7, C)], {}),
    }


def _arrays(cache):
    """The arrays of a (nested) cache tuple, in order."""
    for item in cache:
        if isinstance(item, tuple):
            yield from _arrays(item)
        elif hasattr(item, "dtype") and getattr(item, "ndim", 0):
            yield item


def assert_fp32_cache_narrowed(cache, cache32, inputs, dtype):
    """The 16-bit cache is the fp32 kernel's: each input the caller's own array, each activation the fp32
    one rounded once, each per-row statistic the fp32 one; so half the bytes, statistics apart."""
    assert len(cache) == len(cache32)                                      # the same layout
    for a, a32 in zip(_arrays(cache), _arrays(cache32), strict=True):
        if a.dtype.kind == "b":                                            # a dropout mask: 1 byte either way
            assert a is a32
        elif a.dtype == np.float32:                                        # a statistic, fp32
            assert (a.ndim < inputs[0].ndim or a.shape[-1] == 1) and np.array_equal(a, a32)
        else:
            assert a.dtype == dtype and np.array_equal(f32(a), f32(a32.astype(dtype)))
            assert any(a is x for x in inputs) or not any(np.shares_memory(a, x) for x in inputs)


def within(name, got, ref, bound, fmt, roundings=1):
    """|got - ref| <= roundings u |ref| + (1 + 2^-6) bound + 2^-16 bound / u + tiny, u the format's unit
    roundoff (half its ulp at 1): the one rounding of got (two when ref is rounded too), the first-order
    effect `bound` of the kept cache's rounding (its square is u times smaller), and the fp32 sums'
    noise, 2^-24 times the absolute sums (bound / u) times their lengths (< 2^8 here)."""
    ulp, tiny = FORMATS[fmt][1:]
    u = ulp / 2
    err = np.abs(f32(got).astype(np.float64) - ref)
    tol = roundings * u * np.abs(ref) + (1 + 2.0 ** -6) * bound + 2.0 ** -16 * bound / u + tiny
    assert np.all(err <= tol), f"{fmt} {name}: worst excess {np.max(err - tol):.3g}, max error {err.max():.3g}"


def backward_bounds(name, cache32, dout, u):
    """Per gradient, the first-order bound of what the kept cache's rounding (relative <= u, each kept
    activation) moves it by, from the fp32 cache (float64):
      gelu    t = tanh(.) kept: dx = dout (1 + t + x (1 - t^2) a') / 2, d/dt = dout (1 - 2 t x a') / 2
      swiglu  s, silu kept: dup = dout silu; dgate = dout up s (1 + g (1 - s)), d/ds = dout up (1 + g - 2 g s)
      norms   xhat kept (1/std fp32): dw = sum dout xhat; dx = r (dxhat - [mean dxhat] - xhat mean(dxhat xhat))
              moves by r u |xhat| (|mean(dxhat xhat)| + mean|dxhat xhat|); db not at all"""
    g = dout.astype(np.float64)
    c = [a.astype(np.float64) if hasattr(a, "astype") else a for a in cache32]
    if name == "gelu":
        x, t = c
        a1 = kern.GELU_SCALE * (1 + 3 * kern.GELU_CUBIC * x * x)
        return [0.5 * np.abs(g * (1 - 2 * t * x * a1)) * u * np.abs(t)]
    if name == "swiglu":
        gate, up, s, silu = c
        dgate = np.abs(g * up * (1 + gate - 2 * gate * s)) * u * s
        return [np.concatenate([dgate, u * np.abs(g * silu)], axis=-1)]
    xhat, w, r = c[:3]
    C = xhat.shape[-1]
    dxhat = g * w
    dx = r * u * np.abs(xhat) * (np.abs((dxhat * xhat).mean(-1, keepdims=True))
                                 + np.abs(dxhat * xhat).mean(-1, keepdims=True))
    dw = u * np.abs(g * xhat).reshape(-1, C).sum(0)
    return [dx, dw] + ([np.zeros(C)] if name == "layernorm" else [])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "gelu", "swiglu"])
def test_elementwise_kernels_keep_the_fp32_cache_narrowed(fmt, name):
    """Statistics, tanh and sigmoid in fp32 on the widened inputs, the output rounded once (bit for bit the
    fp32 kernel's, rounded); the cache the fp32 kernel's at 16 bits (statistics fp32); the gradients the
    fp32 pair's within the bound that the kept cache's rounding allows (backward_bounds)."""
    dtype, ulp, _ = FORMATS[fmt]
    forward, backward, shapes, options = _pairs()[name]
    rng = np.random.default_rng(3)
    inputs = [(rng.standard_normal(s) + (1.0 if len(s) == 1 else 0.0)).astype(np.float32).astype(dtype)
              for s in shapes]
    out, cache = forward(*inputs, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32).astype(dtype)
    ref, cache32 = forward(*map(f32, inputs), **options)
    assert out.dtype == dtype and np.array_equal(f32(out), f32(ref.astype(dtype)))
    assert_fp32_cache_narrowed(cache, cache32, inputs, dtype)
    grads, want = backward(dout, cache), backward(f32(dout), cache32)
    grads, want = (grads if isinstance(grads, tuple) else (grads,)), (want if isinstance(want, tuple) else (want,))
    for i, (g, w, bound) in enumerate(zip(grads, want, backward_bounds(name, cache32, dout, ulp / 2), strict=True)):
        assert g.dtype == dtype
        within(f"{name} gradient {i}", g, w.astype(np.float64), bound, fmt)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_layernorm_and_gelu_within_pytorchs(fmt):
    """PyTorch's CPU LayerNorm and tanh-GELU in bf16/fp16 also compute in fp32 and round once: the outputs
    within one ulp. Their backward passes recompute from the 16-bit input where ours reads the kept 16-bit
    normalised input or tanh: dx within one ulp (both roundings) plus backward_bounds. (PyTorch's CPU
    LayerNorm sums dw and db in 16-bit partial sums, 0.3 off on a bf16 sum of 36 terms: those two are
    checked against the fp32 pair instead, in the test above.)"""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle (the hf-oracle extra)")
    dtype, ulp, tiny = FORMATS[fmt]
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    rng = np.random.default_rng(4)
    x = (3 * rng.standard_normal((4, 9, 64))).astype(np.float32).astype(dtype)
    w, b, dout = (rng.standard_normal(s).astype(np.float32).astype(dtype) for s in (64, 64, x.shape))
    t = {k: torch.from_numpy(f32(v)).to(tdtype).requires_grad_() for k, v in (("x", x), ("w", w), ("b", b))}
    tx = torch.from_numpy(f32(x)).to(tdtype).requires_grad_()
    ln = torch.nn.functional.layer_norm(t["x"], (64,), t["w"], t["b"], 1e-5)
    gelu = torch.nn.functional.gelu(tx, approximate="tanh")
    for y in (ln, gelu):
        y.backward(torch.from_numpy(f32(dout)).to(tdtype))
    ln, gelu = ln.detach().float().numpy(), gelu.detach().float().numpy()
    ours_ln, ln_cache = kern.layernorm_forward(x, w, b)
    assert np.all(np.abs(f32(ours_ln) - ln) <= ulp * np.abs(ln) + tiny)
    # For x below about -4, 1 + tanh(u) cancels in fp32 (tanh(u) is -1 within an fp32 ulp, 2^-24 there), and
    # both sides hold that noise times x / 2 (PyTorch's tanh gives 0 where ours gives -1.5e-7 at x = -5):
    # allowed on top of the one 16-bit ulp.
    cancel = 2.0 ** -24 * np.abs(f32(x))
    ours_gelu, gelu_cache = kern.gelu_forward(x)
    assert np.all(np.abs(f32(ours_gelu) - gelu) <= ulp * np.abs(gelu) + tiny + cancel)
    for name, ours, theirs, cache32 in (
            ("layernorm", kern.layernorm_backward(dout, ln_cache)[0], t["x"].grad,
             kern.layernorm_forward(f32(x), f32(w), f32(b))[1]),
            ("gelu", kern.gelu_backward(dout, gelu_cache), tx.grad, kern.gelu_forward(f32(x))[1])):
        theirs = theirs.float().numpy().astype(np.float64)
        within(f"{name} dx against PyTorch", ours, theirs, backward_bounds(name, cache32, dout, ulp / 2)[0], fmt,
               roundings=2)


def attention_bounds(online, q, k, v, probs, out, dout, mask, drop_scale, u):
    """dq, dk, dv's first-order bounds (float64). Dense: the softmax output p is kept (relative u): dv =
    (p m)^T g' moves by u (p m)^T |g'|; ds = p (dp - D), D = sum dp p, by E = u p (|dp - D| + sum |dp| p);
    dq = ds k scale by E |k| scale, dk = ds^T q scale by E^T |q| scale (g' = dout drop_scale, dp = g' v^T m).
    Online: the output o is kept (lse fp32): D = sum dout o moves by u sum |dout o|, ds by p times that,
    dq and dk as above, dv not at all."""
    q, k, v, p, o, g = (a.astype(np.float64) for a in (q, k, v, probs, out, dout))
    m = np.ones_like(p) if mask is None else mask.astype(np.float64)
    scale = 1 / np.sqrt(q.shape[-1])
    g = g * (drop_scale if mask is not None else 1.0)
    if online:
        E = p * (u * np.abs(dout.astype(np.float64) * o).sum(-1, keepdims=True))
        dv = np.zeros_like(v)
    else:
        dp = (g @ v.swapaxes(-1, -2)) * m
        D = (dp * p).sum(-1, keepdims=True)
        E = u * p * (np.abs(dp - D) + (np.abs(dp) * p).sum(-1, keepdims=True))
        dv = u * (p * m).swapaxes(-1, -2) @ np.abs(g)
    return E @ np.abs(k) * scale, E.swapaxes(-1, -2) @ np.abs(q) * scale, dv


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("online", [False, True], ids=["dense", "online"])
def test_attention_keeps_the_fp32_cache_narrowed(fmt, online):
    """q k^T, the softmax and its dropout, and the product with v in fp32; the output rounded once (bit for
    bit); the cache the fp32 kernel's at 16 bits (the softmax output, or the online softmax's output, in
    16 bits, its log-sum-exp in fp32, as Megatron keeps them); dq, dk, dv within attention_bounds."""
    from mpi_tp.core import kernels_attention as ka
    from mpi_tp.core import kernels_online as ko
    dtype, ulp, _ = FORMATS[fmt]
    forward, backward = ((ko.online_attention_forward, ko.online_attention_backward) if online
                         else (kern.attention_forward, kern.attention_backward))
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((2, 3, 20, 8)).astype(np.float32).astype(dtype) for _ in range(4))
    mask = rng.random((2, 3, 20, 20)) > 0.2
    drop = (lambda r, c: mask[..., r, c]) if online else mask          # the online form asks tile by tile
    out, cache = forward(q, k, v, drop, 1.25, block=8)
    ref, cache32 = forward(f32(q), f32(k), f32(v), drop, 1.25, block=8)
    assert out.dtype == dtype and np.array_equal(f32(out), f32(ref.astype(dtype)))
    assert_fp32_cache_narrowed(cache, cache32, (q, k, v, drop, 1.25), dtype)
    if online:
        assert cache[3] is out                                   # the output, kept once
    probs = kern.attention_forward(f32(q), f32(k), f32(v), block=8)[1][3]
    bounds = attention_bounds(online, q, k, v, probs, f32(ref), dout, mask, 1.25, ulp / 2)
    for name, g, w, bound in zip("qkv", backward(dout, cache), backward(f32(dout), cache32), bounds, strict=True):
        assert g.dtype == dtype
        within(f"d{name}", g, w.astype(np.float64), bound, fmt)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_embedding_and_cross_entropy_accumulate_in_fp32(fmt):
    dtype = FORMATS[fmt][0]
    rng = np.random.default_rng(6)
    table = rng.standard_normal((11, 6)).astype(np.float32).astype(dtype)
    ids = rng.integers(0, 11, (4, 9))                                      # ids repeat: their rows summed
    out, cache = kern.embedding_forward(ids, table)
    assert out.dtype == dtype and np.array_equal(f32(out), f32(table)[ids])          # a gather: exact
    dout = rng.standard_normal(out.shape).astype(np.float32).astype(dtype)
    dtable = kern.embedding_backward(dout, cache)
    want = kern.embedding_backward(f32(dout), (ids, table.shape, np.dtype(np.float32)))
    assert dtable.dtype == dtype and np.array_equal(f32(dtable), f32(want.astype(dtype)))
    logits = (4 * rng.standard_normal((4, 9, 11))).astype(np.float32).astype(dtype)
    loss, cache = kern.cross_entropy_forward(logits, ids)
    loss32, cache32 = kern.cross_entropy_forward(f32(logits), ids)
    assert isinstance(loss, float) and loss == loss32 and cache[0].dtype == np.float32   # fp32 throughout
    dlogits = kern.cross_entropy_backward(0.5, cache)
    assert dlogits.dtype == dtype and np.array_equal(f32(dlogits),
                                                     f32(kern.cross_entropy_backward(0.5, cache32).astype(dtype)))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rope_is_the_fp32_rotation_rounded_once(fmt):
    from mpi_tp.core import kernels_llama as kl
    dtype = FORMATS[fmt][0]
    cos, sin = kl.rope_tables(np.arange(7), 8, 10000.0, np.float32)
    x, dout = (np.random.default_rng(s).standard_normal((2, 3, 7, 8)).astype(np.float32).astype(dtype) for s in (7, 8))
    out, cache = kl.rope_forward(x, cos, sin)
    ref, cache32 = kl.rope_forward(f32(x), cos, sin)
    assert out.dtype == dtype and np.array_equal(f32(out), f32(ref.astype(dtype)))
    dx = kl.rope_backward(dout, cache)
    assert dx.dtype == dtype and np.array_equal(f32(dx), f32(kl.rope_backward(f32(dout), cache32).astype(dtype)))
