"""GELU's, LayerNorm's and the softmax's elementwise work fused into kernels on CuPy (kernels_fused).

    python -m pytest -q --with-mpi tests/test_standin_kernels.py

On the CuPy stand-in (mpi_tp.core.standin; tests/test_standin.py says what it checks) the kernels
give the NumPy path's numbers bit for bit, forward and backward, float32 and float64: the fused
functions do the NumPy path's arithmetic in its order (on a GPU a compiler may contract a multiply
and an add, FMA: within float rounding, which tests/test_gpu.py allows). And each call launches
the kernels that module's docstring lists: the stand-in counts every device operation (an upper
bound on CuPy's launches) and a cupy.fuse function as one. What this cannot show is their speed.
"""
import numpy
import pytest
from test_standin import cupy  # noqa: F401 (the fixture: the stand-in as the backend for one test)

from mpi_tp.core import kernels, kernels_online, standin
from mpi_tp.core.standin.state import StrictnessError

SHAPE = (2, 5, 24)                               # (B, S, C)
LAUNCHES = {"gelu_forward": 1, "gelu_backward": 1, "layernorm_forward": 6, "layernorm_backward": 7,
            "attention_forward": 9, "attention_backward": 11}


def run_all(x, dout, w, b) -> tuple[dict, dict]:
    """({kernel: its outputs}, {kernel: the device operations it launched}) on the current backend."""
    c = standin.counters
    results, launched = {}, {}
    heads = x.reshape(2, 5, 4, 6).swapaxes(1, 2)                     # (B, H, S, hs): q = k = v, one block
    kernels.attention_forward(heads, heads, heads)                   # the causal mask made once, then cached
    for name, forward, kept in (("gelu", lambda: kernels.gelu_forward(x), lambda c: [c[1]]),
                                ("layernorm", lambda: kernels.layernorm_forward(x, w, b), lambda c: [c[0], c[2]]),
                                ("attention", lambda: kernels.attention_forward(heads, heads, heads),
                                 lambda c: [c[3]])):
        c.reset()
        out, cache = forward()
        launched[f"{name}_forward"] = c.kernels
        results[f"{name}_forward"] = [out] + kept(cache)
        c.reset()
        grads = getattr(kernels, f"{name}_backward")(heads if name == "attention" else dout, cache)
        launched[f"{name}_backward"] = c.kernels
        results[f"{name}_backward"] = [grads] if name == "gelu" else list(grads)
    return results, launched


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_kernels_give_the_numpy_paths_numbers_in_fewer_kernels(cupy, dtype):  # noqa: F811
    rng = numpy.random.default_rng(0)
    host = [rng.standard_normal(SHAPE).astype(dtype) * 3 + 1, rng.standard_normal(SHAPE).astype(dtype),
            rng.standard_normal(SHAPE[-1]).astype(dtype), rng.standard_normal(SHAPE[-1]).astype(dtype)]
    reference, _ = run_all(*host)                                    # host arrays: the NumPy path
    results, launched = run_all(*(cupy.asarray(a) for a in host))
    results = {k: [cupy.asnumpy(a) for a in v] for k, v in results.items()}
    assert launched == LAUNCHES, launched
    for name, ref in reference.items():
        assert all(a.dtype == r.dtype and numpy.array_equal(a, r) for a, r in zip(results[name], ref)), name


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_online_softmax_fuses_its_tiles_and_gives_the_numpy_paths_numbers(cupy, dtype):  # noqa: F811
    """The online softmax (S >= ONLINE_FROM, and ring attention's blocks) by tiles of 2 x 2 over S = 5: each
    tile's shifted exponential one fused kernel forward and backward, its backward's tail one; bit for bit."""
    rng = numpy.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((2, 3, 5, 4)).astype(dtype) for _ in range(4))

    def run(xp):
        out, cache = kernels_online.online_attention_forward(*(xp.asarray(a) for a in (q, k, v)), block=2)
        return [out, cache[4]] + list(kernels_online.online_attention_backward(xp.asarray(dout), cache))
    reference = run(numpy)
    standin.counters.reset()
    got = [cupy.asnumpy(a) for a in run(cupy)]
    names = dict(standin.counters.kernel_names)
    tiles = 1 + 2 + 3                                                # causal tiles: query block i sees i + 1 key blocks
    assert names.get("fuse:softmax_exp") == 2 * tiles and names.get("fuse:softmax_backward_tail") == tiles, names
    assert all(a.dtype == r.dtype and numpy.array_equal(a, r) for a, r in zip(got, reference))


def test_the_standin_refuses_inside_a_fused_function_what_cupy_cannot_fuse(cupy):  # noqa: F811
    """A cupy.fuse function is traced by CuPy with proxies: only elementwise ufuncs, arithmetic and a few
    reductions. The stand-in runs the function itself, so it refuses the rest (indexing, views, matmul,
    in-place updates, other functions, reading a value), and the fused functions above are checked to
    keep to what fuses."""
    x = cupy.asarray(numpy.arange(6.0).reshape(2, 3))
    assert float(cupy.fuse()(lambda a: cupy.exp(a) * 2.0 + a.sum())(x)[1, 2]) == numpy.exp(5.0) * 2 + 15
    for bad in (lambda a: a[0] * 2.0, lambda a: a.reshape(3, 2) + 1.0, lambda a: a @ a.T,
                lambda a: cupy.concatenate([a, a]), lambda a: a if float(a.max()) > 0 else -a,
                lambda a: cupy.multiply(a, 2.0, out=a)):
        with pytest.raises(StrictnessError, match="cupy.fuse"):
            cupy.fuse()(bad)(x)

    def in_place(a):
        a += 1.0
        return a
    with pytest.raises(StrictnessError, match="cupy.fuse"):
        cupy.fuse()(in_place)(x)


def test_windowed_online_softmax_and_tile_masks_on_the_standin(cupy):  # noqa: F811
    """A sliding window (its tiles' biases, the merge's shift where a row has seen nothing) and dropout masks
    drawn by tile on the device (philox.stream_rows' philox4x64 path, every row at once) give the NumPy
    path's bits: the masks themselves and the attention forward and backward."""
    from mpi_tp.core import philox
    key, rows, sites = philox.split_key(77), numpy.arange(2)[:, None], numpy.arange(3)[None, :]
    starts = range(3 * 9 + 1, 8 * 9 + 1, 9)                          # rows 3 ... 7 of a (9, 9) mask, keys 1 ... 6
    host = philox.stream_rows(key, rows, sites, 4, starts, 6, at_least=20000)
    device = philox.stream_rows(key, rows, sites, 4, starts, 6, xp=cupy, at_least=20000)
    assert numpy.array_equal(cupy.asnumpy(device), host)
    rng = numpy.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((2, 3, 9, 4)) for _ in range(4))
    mask = rng.random((2, 3, 9, 9)) > 0.3

    def run(xp):
        drop = xp.asarray(mask)
        out, cache = kernels_online.online_attention_forward(*(xp.asarray(a) for a in (q, k, v)),
                                                             lambda r, c: drop[..., r, c], 1.25, block=2, window=3)
        return [out, cache[4]] + list(kernels_online.online_attention_backward(xp.asarray(dout), cache))
    reference = run(numpy)
    got = [cupy.asnumpy(a) for a in run(cupy)]
    assert all(numpy.array_equal(a, r) for a, r in zip(got, reference))
