"""The linear kernels on 16-bit storage (mpi_tp.core.kernels_half) through mpi_tp.core.kernels: products
accumulated in fp32 and rounded once to the inputs' format.

Two references. The definition: the fp32 kernel on the widened inputs (exact: every 16-bit value is an
fp32 value), rounded once with ml_dtypes / NumPy's float16 casts, must equal ours bit for bit (our
GEMM is that same fp32 GEMM). PyTorch's bf16 and fp16 linear layers on the CPU (fp32 accumulation
too, in oneDNN's order): an fp32 sum in another order differs by a few fp32 ulps, which can move the
rounded result by one 16-bit ulp, so they must agree within one ulp of the format:
|ours - torch| <= 2^-7 |torch| for bf16 (8 significant bits), 2^-10 |torch| for fp16 (11), plus the
format's smallest normal for results near zero.
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
    x, w, b, dout = operands("bf16")
    buf = np.zeros(w.shape, dtype=np.float32)
    dw, db = kern.linear_backward_weight(dout, x, True, dw_out=buf)
    want, want_db = kern.linear_backward_weight(f32(dout), f32(x), True)
    assert dw is buf and np.array_equal(buf, want) and db.dtype == np.float32 and np.array_equal(db, want_db)
    assert not np.array_equal(buf, f32(buf.astype(ml_dtypes.bfloat16)))       # some bits below bf16's


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_within_one_ulp_of_pytorch(fmt):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle (the hf-oracle extra)")
    dtype, ulp, tiny = FORMATS[fmt]
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


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "gelu", "swiglu"])
def test_elementwise_kernels_are_the_fp32_pair_rounded_once(fmt, name):
    """Statistics, tanh and sigmoid in fp32 on the widened inputs; the output and each gradient rounded once;
    the cache holds the 16-bit inputs only (what a fused GPU kernel keeps)."""
    dtype = FORMATS[fmt][0]
    forward, backward, shapes, options = _pairs()[name]
    rng = np.random.default_rng(3)
    inputs = [(rng.standard_normal(s) + (1.0 if len(s) == 1 else 0.0)).astype(np.float32).astype(dtype)
              for s in shapes]
    out, cache = forward(*inputs, **options)
    dout = rng.standard_normal(out.shape).astype(np.float32).astype(dtype)
    ref, cache32 = forward(*map(f32, inputs), **options)
    assert out.dtype == dtype and np.array_equal(f32(out), f32(ref.astype(dtype)))
    assert all(a.itemsize == 2 for a in cache[0])
    grads, want = backward(dout, cache), backward(f32(dout), cache32)
    grads, want = (grads if isinstance(grads, tuple) else (grads,)), (want if isinstance(want, tuple) else (want,))
    for i, (g, w) in enumerate(zip(grads, want)):
        assert g.dtype == dtype and np.array_equal(f32(g), f32(w.astype(dtype))), f"{name} gradient {i}"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_layernorm_and_gelu_within_pytorchs(fmt):
    """PyTorch's CPU LayerNorm and tanh-GELU in bf16/fp16 also compute in fp32 and round once: one ulp."""
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle (the hf-oracle extra)")
    dtype, ulp, tiny = FORMATS[fmt]
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    rng = np.random.default_rng(4)
    x = (3 * rng.standard_normal((4, 9, 64))).astype(np.float32).astype(dtype)
    w, b = (rng.standard_normal(64).astype(np.float32).astype(dtype) for _ in range(2))
    t = {k: torch.from_numpy(f32(v)).to(tdtype) for k, v in (("x", x), ("w", w), ("b", b))}
    ln = torch.nn.functional.layer_norm(t["x"], (64,), t["w"], t["b"], 1e-5).float().numpy()
    gelu = torch.nn.functional.gelu(t["x"], approximate="tanh").float().numpy()
    assert np.all(np.abs(f32(kern.layernorm_forward(x, w, b)[0]) - ln) <= ulp * np.abs(ln) + tiny)
    # For x below about -4, 1 + tanh(u) cancels in fp32 (tanh(u) is -1 within an fp32 ulp, 2^-24 there), and
    # both sides hold that noise times x / 2 (PyTorch's tanh gives 0 where ours gives -1.5e-7 at x = -5):
    # allowed on top of the one 16-bit ulp.
    cancel = 2.0 ** -24 * np.abs(f32(x))
    assert np.all(np.abs(f32(kern.gelu_forward(x)[0]) - gelu) <= ulp * np.abs(gelu) + tiny + cancel)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("online", [False, True], ids=["dense", "online"])
def test_attention_is_the_fp32_pair_rounded_once(fmt, online):
    """q k^T, the softmax and its dropout, and the product with v in fp32; the output and dq, dk, dv rounded
    once; the cache holds the 16-bit q, k, v only (the backward recomputes, as FlashAttention's does)."""
    from mpi_tp.core import kernels_attention as ka
    dtype = FORMATS[fmt][0]
    forward, backward = ((ka.online_attention_forward, ka.online_attention_backward) if online
                         else (kern.attention_forward, kern.attention_backward))
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((2, 3, 20, 8)).astype(np.float32).astype(dtype) for _ in range(4))
    mask = rng.random((2, 3, 20, 20)) > 0.2
    out, cache = forward(q, k, v, mask, 1.25, block=8)
    ref, cache32 = forward(f32(q), f32(k), f32(v), mask, 1.25, block=8)
    assert out.dtype == dtype and np.array_equal(f32(out), f32(ref.astype(dtype)))
    assert [a.itemsize for a in cache[0][:3]] == [2, 2, 2]
    for name, g, w in zip("qkv", backward(dout, cache), backward(f32(dout), cache32)):
        assert g.dtype == dtype and np.array_equal(f32(g), f32(w.astype(dtype))), f"d{name}"


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
