"""mpi_tp.core.philox: Philox4x64-10 by counter, on the CPU (numpy's C Philox) and in uint64 array
arithmetic (the CuPy path, run here on NumPy).

    .venv/bin/python -m pytest -q tests/test_philox.py

`philox4x64` against Random123's published known answers and against numpy's Philox bit for bit
(that is what vouches for the bits CuPy draws: the same function, another array module); a
stream's slice against the slice of the whole stream, at odd offsets and lengths, both paths.
No MPI: under mpiexec every rank runs them alone.
"""
import numpy as np
import pytest

from mpi_tp.core import philox

M = (1 << 64) - 1
# Random123's kat_vectors for philox4x64_10: (counter, key, output)
KAT = [((0, 0, 0, 0), (0, 0),
        (0x16554d9eca36314c, 0xdb20fe9d672d0fdc, 0xd7e772cee186176b, 0x7e68b68aec7ba23b)),
       ((M, M, M, M), (M, M),
        (0x87b092c3013fe90b, 0x438c3c67be8d0224, 0x9cc7d7c69cd777b6, 0xa09caebf594f0ba0)),
       ((0x243f6a8885a308d3, 0x13198a2e03707344, 0xa4093822299f31d0, 0x082efa98ec4e6c89),
        (0x452821e638d01377, 0xbe5466cf34e90c6c),
        (0xa528f45403e61d95, 0x38c72dbd566e9788, 0xa5a1610e72fd18b5, 0x57bd43b5e52b7fe6))]


@pytest.mark.parametrize("counter,key,want", KAT)
def test_generic_philox_known_answers(counter, key, want):
    got = philox.philox4x64(*counter, key)
    assert [int(x) for x in got] == list(want), [hex(int(x)) for x in got]


def numpy_block(counter: int, key) -> list[int]:
    """numpy's Philox output for one 256-bit counter value (numpy adds 1 before each block)."""
    return numpy_raw(counter, key, 4).tolist()


def numpy_raw(counter: int, key, n: int):
    return np.random.Philox(counter=(counter - 1) % (1 << 256), key=key[0] | key[1] << 64).random_raw(n)


def test_generic_philox_equals_numpy_bits():
    """Random counters and keys, their extremes, and carries across the 64-bit counter words."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 1 << 64, size=(64, 6), dtype=np.uint64)
    words[:4] = [[0] * 6, [M] * 6, [M, 0, M, 0, M, 0], [1 << 63] * 6]
    got = philox.philox4x64(*(words[:, j] for j in range(4)), (7, 9))          # 64 counters at once
    for n, w in enumerate(words.tolist()):
        counter = w[0] | w[1] << 64 | w[2] << 128 | w[3] << 192
        assert [int(g[n]) for g in got] == numpy_block(counter, (7, 9)), n
        key = (w[4], w[5])
        assert [int(x) for x in philox.philox4x64(*w[:4], key)] == numpy_block(counter, key), n
    # a run of counters from one numpy generator: block b is counter start + b, carries included
    start = (1 << 64) - 3 | 5 << 64 | 6 << 128 | 7 << 192
    raw = numpy_raw(start, (1, 2), 4 * 6).reshape(6, 4)
    blocks = np.arange(6, dtype=np.uint64) + np.uint64((1 << 64) - 3)          # wraps past 2^64 - 1 ...
    carry = (np.arange(6) >= 3).astype(np.uint64)                              # ... and carries into ctr1
    got = philox.philox4x64(blocks, 5 + carry, 6, 7, (1, 2))
    np.testing.assert_array_equal(np.stack(got, axis=-1), raw)


@pytest.mark.parametrize("path", ["numpy", "generic"])
def test_a_slice_of_a_stream_is_the_slice_of_the_whole(path):
    """Words start ... stop - 1 drawn alone equal those of one draw from 0, bit for bit."""
    draw = philox.stream_words if path == "numpy" else philox.generic_words
    key = philox.split_key(2**100 + 12345)
    rows, sites = np.array([0, 3, 1 << 40])[:, None], np.array([1, (5 << 32) | 7])[None, :]
    whole = draw(key, rows, sites, 11, 0, 1000)                                  # (3, 2, 1000)
    assert whole.shape == (3, 2, 1000) and whole.dtype == np.uint16
    for start, stop in [(0, 1), (1, 2), (3, 20), (15, 17), (16, 32), (17, 999), (333, 334), (0, 1000),
                        (7, 7), (511, 1000)]:
        part = draw(key, rows, sites, 11, start, stop)
        np.testing.assert_array_equal(part, whole[..., start:stop], err_msg=f"{path} words {start}:{stop}")


@pytest.mark.parametrize("path", ["numpy", "generic"])
def test_the_rows_of_a_tile_are_the_whole_arrays_rows(path):
    """stream_rows (a tile of a row-major (S, S) array: the attention masks drawn by tile) equals the slice of one
    draw of the whole array, bit for bit: rows whose words share a block, rows a block apart, one word wide,
    descending starts (a generator made again), and the bool masks (NumPy's C Philox advanced from row to
    row; `generic`: philox4x64 on every row at once, the GPU's path)."""
    key = philox.split_key(4242)
    rows, sites = np.array([2, 9])[:, None], np.array([1, 3 << 24])[None, :]
    S = 37
    whole = philox.stream_words(key, rows, sites, 5, 0, S * S).reshape(2, 2, S, S)
    draw = philox.stream_rows if path == "numpy" else (lambda *a, **k: philox._generic_rows(*a[:6], np))
    for t0, n, s0, m in [(0, 5, 0, 5), (3, 9, 1, 13), (10, 20, 0, 37), (20, 17, 5, 3), (36, 1, 30, 7),
                         (4, 6, 0, 1), (0, 37, 0, 37)]:
        got = draw(key, rows, sites, 5, range(t0 * S + s0, (t0 + n) * S + s0, S), m)
        np.testing.assert_array_equal(got, whole[..., t0:t0 + n, s0:s0 + m], err_msg=f"tile {t0, n, s0, m}")
    starts = [5 * S, 2 * S + 3, 2 * S + 4]                                   # not ascending, overlapping blocks
    got = philox.stream_rows(key, rows, sites, 5, starts, 4)
    flat = whole.reshape(2, 2, -1)
    np.testing.assert_array_equal(got, np.stack([flat[..., a:a + 4] for a in starts], axis=-2))
    keep = philox.stream_rows(key, rows, sites, 5, starts, 4, at_least=30000)
    np.testing.assert_array_equal(keep, got >= 30000)


def test_numpy_and_generic_paths_give_the_same_words_and_masks():
    key = philox.split_key(1337)
    rows, heads = np.arange(4, 7)[:, None, None], np.arange(3)[None, :, None]
    for start, stop in [(0, 64), (5, 300), (99, 100)]:
        a = philox.stream_words(key, rows, heads, np.array([0, 2**64 - 1], dtype=np.uint64), start, stop)
        b = philox.generic_words(key, rows, heads, np.array([0, 2**64 - 1], dtype=np.uint64), start, stop)
        np.testing.assert_array_equal(a, b)
        assert a.shape == (3, 3, 2, stop - start)
        for at_least in (0, 6554, 65535):
            keep = philox.stream_words(key, rows, heads, 0, start, stop, at_least=at_least)
            words = philox.stream_words(key, rows, heads, 0, start, stop)
            assert keep.dtype == np.bool_
            np.testing.assert_array_equal(keep, words >= at_least)


def test_words_follow_numpys_stream_order():
    """Word e of a stream: bits 16 (e % 4) of output (e // 4) % 4 of block e // 16 (numpy's own order)."""
    key = (3, 4)
    words = philox.stream_words(key, 8, 9, 10, 0, 40)
    raw = numpy_raw(8 << 64 | 9 << 128 | 10 << 192, key, 12)            # blocks 0, 1 and 2
    want = [(int(raw[e // 4]) >> (16 * (e % 4))) & 0xFFFF for e in range(40)]
    assert words.tolist() == want


def test_split_key():
    assert philox.split_key(5) == (5, 0)
    assert philox.split_key(3 << 64 | 2) == (2, 3)
    for bad in (-1, 1 << 128):
        with pytest.raises(ValueError, match="seed"):
            philox.split_key(bad)
