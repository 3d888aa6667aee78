"""Tests for mpi_tp.core.segment, the embedding's backward without atomics (issue 21, finding 5).

    .venv/bin/python -m pytest -q tests/test_segment.py

segment_sum against its naive Python version (bitwise: the order it promises), against
numpy.add.at (float64, to rounding), on repeated, missing and all-equal keys; the same bits
run after run and whatever the other keys' rows are or where they sit (an atomic accumulation
would break both on a GPU); CuPy bitwise equal to NumPy when a GPU is there; and no ufunc.at or
scatter_add left in mpi_tp/ for an accumulation to return through.
No MPI: under `mpiexec -n 2 python -m pytest --with-mpi` every rank runs them alone.
"""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from mpi_tp.core import kernels as kern
from mpi_tp.core.segment import segment_sum, segment_sum_naive

ROOT = Path(__file__).resolve().parents[1]


def add_at(keys, values, n):
    out = np.zeros((n, *values.shape[1:]), dtype=values.dtype)
    np.add.at(out, keys, values)
    return out


def bitwise_equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


KEYS = {   # name -> (keys, n): repeated, missing, all equal, all distinct, one row, none
    "repeated and missing": (np.array([3, 1, 3, 3, 0, 1, 3, 5, 3]), 7),     # 2, 4 and 6 never appear
    "all equal": (np.full(11, 2), 4),
    "all distinct": (np.array([4, 0, 3, 1]), 5),
    "one row": (np.array([2]), 3),
    "none": (np.zeros(0, dtype=np.int64), 3),
}


@pytest.mark.parametrize("name", sorted(KEYS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_segment_sum_small_cases(name, dtype):
    keys, n = KEYS[name]
    values = np.random.default_rng(1).standard_normal((len(keys), 3)).astype(dtype)
    got = segment_sum(keys, values, n)
    assert got.dtype == dtype and got.shape == (n, 3)
    assert bitwise_equal(got, segment_sum_naive(keys, values, n))
    np.testing.assert_allclose(got, add_at(keys, values, n), rtol=1e-6 if dtype == np.float32 else 1e-15,
                               atol=1e-6 if dtype == np.float32 else 1e-15)
    missing = np.setdiff1d(np.arange(n), keys)
    assert not got[missing].any(), "a key with no rows must stay exactly 0"


def test_segment_sum_exact_integers_and_order():
    """Integers in floats sum exactly in any order: equal to add.at to the bit. The pairwise order shows
    where sums round: ((r0 + r1) + (r2 + r3)) + r4, not add.at's (((r0 + r1) + r2) + r3) + r4."""
    keys = np.array([0, 1, 0, 0, 1, 0, 0])
    values = np.arange(7.0)[:, None] * np.array([1.0, -2.0])
    assert bitwise_equal(segment_sum(keys, values, 3), add_at(keys, values, 3))
    big, tiny = 2.0 ** 53, 1.0
    values = np.array([[big], [tiny], [tiny], [tiny], [tiny]])     # one key, R = 5
    got = segment_sum(np.zeros(5, dtype=int), values, 1)[0, 0]
    assert got == ((big + tiny) + (tiny + tiny)) + tiny == big + 4.0     # exact, here
    assert add_at(np.zeros(5, dtype=int), values, 1)[0, 0] == big      # each + 1 rounds away


@pytest.mark.parametrize("V,N", [(5, 200), (50, 200), (1000, 300)])
def test_segment_sum_random_against_naive_and_add_at(V, N):
    rng = np.random.default_rng(V + N)
    keys = rng.integers(0, V, N) if V > 5 else rng.choice(V, N, p=[0.7, 0.2, 0.1, 0.0, 0.0])   # skewed, 2 missing
    values = rng.standard_normal((N, 4))
    got = segment_sum(keys, values, V)
    assert bitwise_equal(got, segment_sum_naive(keys, values, V))
    scale = add_at(keys, np.abs(values), V)                             # each sum's sum of |terms|
    err = np.abs(got - add_at(keys, values, V)) / np.maximum(scale, 1e-300)
    assert err.max() < 1e-15 * max(2.0, np.log2(N)), f"max relative error {err.max():.2e}"
    f32 = segment_sum(keys, values.astype(np.float32), V)
    assert bitwise_equal(f32, segment_sum_naive(keys, values.astype(np.float32), V))


def _moved(rng, keys, values, extra=0):
    """The same rows at other places (each key's rows still in their order), plus `extra` rows of a new key."""
    where = rng.permutation(len(keys) + extra)
    new_keys = np.full(len(keys) + extra, keys.max() + 1)
    new_values = rng.standard_normal((len(keys) + extra, values.shape[1]))
    for v in np.unique(keys):
        mine = np.sort(where[:np.count_nonzero(keys == v)])
        where = where[len(mine):]
        new_keys[mine], new_values[mine] = v, values[keys == v]
    return new_keys, new_values


def test_the_same_bits_run_after_run_and_wherever_the_rows_sit():
    rng = np.random.default_rng(7)
    keys, values = rng.integers(0, 30, 500), rng.standard_normal((500, 8)).astype(np.float32)
    first = segment_sum(keys, values, 40)
    for _ in range(3):
        assert bitwise_equal(segment_sum(keys, values, 40), first)
    for extra in (0, 37):
        k2, v2 = _moved(rng, keys, values, extra)
        got = segment_sum(k2, v2.astype(np.float32), 40)
        assert bitwise_equal(got[:30], first[:30]), "a key's sum changed with other keys' rows or their places"


def test_equal_contributions_in_any_order():
    """Rows of one key that are equal may be permuted freely: every order of them gives the same bits."""
    rng = np.random.default_rng(8)
    keys = rng.integers(0, 6, 400)
    per_key = rng.standard_normal((6, 5))
    values = per_key[keys]                                              # equal rows for equal keys
    first = segment_sum(keys, values, 6)
    for _ in range(3):
        p = rng.permutation(400)
        assert bitwise_equal(segment_sum(keys[p], values[p], 6), first)


def test_embedding_backward_is_the_segment_sum():
    rng = np.random.default_rng(9)
    table = rng.standard_normal((17, 6))
    ids = rng.integers(0, 17, (3, 40))
    _, cache = kern.embedding_forward(ids, table)
    dout = rng.standard_normal((3, 40, 6))
    dtable = kern.embedding_backward(dout, cache)
    assert bitwise_equal(dtable, segment_sum_naive(ids.reshape(-1), dout.reshape(-1, 6), 17))
    np.testing.assert_allclose(dtable, add_at(ids.reshape(-1), dout.reshape(-1, 6), 17), rtol=1e-14, atol=1e-14)
    dtable32 = kern.embedding_backward(dout.astype(np.float32), (ids, table.shape, np.float64))
    assert dtable32.dtype == np.float64, "summed in the table's dtype, as add.at into it did"


def test_no_atomic_accumulation_left_in_mpi_tp():
    """ufunc.at (numpy.add.at) and cupyx.scatter_add accumulate with float atomics on a GPU: none in mpi_tp/
    (but in mpi_tp/core/standin/, where present: the CuPy stand-in implements cupyx.scatter_add to count them)."""
    found = []
    for path in sorted((ROOT / "mpi_tp").rglob("*.py")):
        if (ROOT / "mpi_tp" / "core" / "standin") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name == "scatter_add" or (name == "at" and isinstance(node, ast.Attribute)
                                         and isinstance(node.value, ast.Attribute)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "accumulations by ufunc.at / scatter_add (use mpi_tp.core.segment): " + ", ".join(found)


def test_cupy_gives_numpy_bits(monkeypatch):
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("CuPy sees no GPU")
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("CuPy has no working GPU")
    from mpi_tp.core import backend
    monkeypatch.setattr(backend, "_xp", cupy)  # what backend.use("cupy") sets, undone after the test
    monkeypatch.setattr(backend, "_name", "cupy")
    rng = np.random.default_rng(10)
    keys, values = rng.integers(0, 50, 4000), rng.standard_normal((4000, 64)).astype(np.float32)
    want = segment_sum(keys, values, 64)
    for _ in range(3):
        got = segment_sum(cupy.asarray(keys), cupy.asarray(values), 64)
        assert isinstance(got, cupy.ndarray) and bitwise_equal(cupy.asnumpy(got), want)
