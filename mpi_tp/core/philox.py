"""Counter-based random bits: Philox4x64-10 (Salmon et al. 2011, "Parallel random numbers: as easy
as 1, 2, 3"), numpy.random.Philox's generator; its 4x32 sibling is cuRAND's and PyTorch's CUDA
generator, from which Megatron draws its dropout masks.

Philox is a keyed bijection of a 256-bit counter: bits = philox(counter, key). Nothing is carried
from one draw to the next, so any rank can draw any element directly, by its counter, and every
layout draws the same bits for the same element (mpi_tp.model.dropout builds its masks on this).

A *stream* here is the counter words (ctr1, ctr2, ctr3) held fixed, with word ctr0 counting its
blocks of 4 x 64 bits, each cut into 16 words of 16 bits (little-endian):

    block ctr0 of the stream = philox((ctr0, ctr1, ctr2, ctr3), key)          4 outputs of 64 bits
    word elem of the stream  = bits 16 (elem % 4) ... of output (elem // 4) % 4 of block elem // 16

`stream_words` returns words start ... stop - 1 of many streams at once. On NumPy it runs numpy's
C Philox once per stream, its counter set just before the first block needed (numpy increments
the counter before each block); on CuPy it runs `philox4x64`, the same arithmetic written with
uint64 array operations only (so it runs on the device; there are no 128-bit products: the high
half of a 64-bit product is built from 32-bit halves). tests/test_philox.py checks `philox4x64`
on NumPy bit for bit against numpy's C Philox and Random123's known answers, which is what
vouches for the bits drawn on the GPU.
"""
from __future__ import annotations

import numpy

M0, M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157     # the round multipliers
W0, W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B     # the key schedule's increments (golden ratio, sqrt 3)
ROUNDS = 10
MASK64, MASK32 = (1 << 64) - 1, (1 << 32) - 1
WORDS_PER_BLOCK = 16                                 # 256 bits of output per counter value, 16-bit words


def split_key(seed: int) -> tuple[int, int]:
    """The 128-bit Philox key (k0, k1) of a non-negative seed below 2**128."""
    if not 0 <= seed < 1 << 128:
        raise ValueError(f"seed {seed}: use an integer in [0, 2**128)")
    return seed & MASK64, seed >> 64


def _mulhilo(a, m: int, xp):
    """(high, low) 64-bit halves of the 128-bit product a * m, a uint64 array, m a constant."""
    u32, u = xp.uint64(32), xp.uint64
    m_lo, m_hi = u(m & MASK32), u(m >> 32)
    a_lo, a_hi = a & u(MASK32), a >> u32
    ll, lh, hl = a_lo * m_lo, a_lo * m_hi, a_hi * m_lo                 # each < 2**64: no overflow
    mid = (ll >> u32) + (lh & u(MASK32)) + (hl & u(MASK32))           # < 3 * 2**32
    hi = a_hi * m_hi + (lh >> u32) + (hl >> u32) + (mid >> u32)
    return hi, a * u(m)                                               # the low half wraps mod 2**64


def philox4x64(ctr0, ctr1, ctr2, ctr3, key: tuple[int, int], xp=numpy):
    """Philox4x64-10 of the counters (ctr0, ctr1, ctr2, ctr3), uint64 arrays that broadcast together;
    returns the four uint64 output arrays. Any array module with uint64 arithmetic (NumPy, CuPy)."""
    k0, k1 = key
    ctrs = xp.broadcast_arrays(*(xp.asarray(c, dtype=xp.uint64) for c in (ctr0, ctr1, ctr2, ctr3)))
    shape = ctrs[0].shape              # flat while computing: 0-d would give numpy scalars, whose products
    ctr0, ctr1, ctr2, ctr3 = (c.reshape(-1) for c in ctrs)          # warn when they wrap
    for r in range(ROUNDS):
        if r:                                                         # the key is bumped between rounds
            k0, k1 = (k0 + W0) & MASK64, (k1 + W1) & MASK64
        hi0, lo0 = _mulhilo(ctr0, M0, xp)
        hi1, lo1 = _mulhilo(ctr2, M1, xp)
        ctr0, ctr1, ctr2, ctr3 = hi1 ^ ctr1 ^ xp.uint64(k0), lo1, hi0 ^ ctr3 ^ xp.uint64(k1), lo0
    return tuple(c.reshape(shape) for c in (ctr0, ctr1, ctr2, ctr3))


def _blocks(start: int, stop: int) -> tuple[int, int]:
    """The blocks [b0, b1) that hold words start ... stop - 1."""
    return start // WORDS_PER_BLOCK, -(-stop // WORDS_PER_BLOCK)


def stream_words(key: tuple[int, int], ctr1, ctr2, ctr3, start: int, stop: int, xp=numpy, at_least=None):
    """uint16 words start ... stop - 1 of the streams (ctr1, ctr2, ctr3): integer arrays (or ints) that
    broadcast to the streams' shape; returns (*shape, stop - start). With `at_least`, the bool
    array words >= at_least instead (compared stream by stream: no array of words in between).

    NumPy: numpy's C Philox, one call per stream; any other xp (CuPy): `philox4x64` (via
    `generic_words`), every stream at once on the device.
    """
    if xp is not numpy:
        words = generic_words(key, ctr1, ctr2, ctr3, start, stop, xp)
        return words if at_least is None else words >= xp.uint16(at_least)
    b0, b1 = _blocks(start, stop)
    skip = start - b0 * WORDS_PER_BLOCK
    shape = numpy.broadcast_shapes(*(numpy.shape(c) for c in (ctr1, ctr2, ctr3)))
    streams = zip(*(numpy.broadcast_to(numpy.asarray(c, dtype=numpy.uint64), shape).reshape(-1).tolist()
                    for c in (ctr1, ctr2, ctr3)))
    out = numpy.empty((int(numpy.prod(shape)), stop - start), bool if at_least is not None else numpy.uint16)
    for j, (w1, w2, w3) in enumerate(streams):
        counter = ((w3 << 192 | w2 << 128 | w1 << 64 | b0) - 1) % (1 << 256)   # numpy adds 1 first
        bits = numpy.random.Philox(counter=counter, key=key[0] | key[1] << 64)
        raw = bits.random_raw(4 * (b1 - b0))                                   # 4 outputs per block
        words = raw.astype("<u8", copy=False).view("<u2")[skip:skip + stop - start]
        if at_least is None:
            out[j] = words
        else:
            numpy.greater_equal(words, numpy.uint16(at_least), out=out[j])
    return out.reshape(*shape, stop - start)


def generic_words(key: tuple[int, int], ctr1, ctr2, ctr3, start: int, stop: int, xp=numpy):
    """`stream_words` by `philox4x64` on xp arrays: the device path (here on any xp, for tests)."""
    b0, b1 = _blocks(start, stop)
    skip = start - b0 * WORDS_PER_BLOCK
    ctr0 = xp.arange(b0, b1, dtype=xp.uint64)                               # (blocks,)
    ctr1, ctr2, ctr3 = (xp.asarray(c, dtype=xp.uint64)[..., None] for c in (ctr1, ctr2, ctr3))   # (..., 1)
    out = xp.stack(philox4x64(ctr0, ctr1, ctr2, ctr3, key, xp), axis=-1)    # (..., blocks, 4) uint64
    shape = out.shape[:-2]
    words = out.reshape(*shape, -1).view(xp.uint16)                         # (..., 16 blocks), little-endian
    return words[..., skip:skip + stop - start]


def stream_rows(key: tuple[int, int], ctr1, ctr2, ctr3, starts, width: int, xp=numpy, at_least=None):
    """Words start ... start + width - 1 of the streams (ctr1, ctr2, ctr3) for each of `starts` (ascending
    ints): (*shape, len(starts), width); with `at_least`, bool as in `stream_words`. The rows of a tile
    of a row-major array (a tile of the attention masks: mpi_tp.model.dropout), without drawing the words
    between them. NumPy: one C Philox per stream, advanced from row to row; other xp: `philox4x64`."""
    starts = [int(s) for s in starts]
    if xp is not numpy:
        words = _generic_rows(key, ctr1, ctr2, ctr3, starts, width, xp)
        return words if at_least is None else words >= xp.uint16(at_least)
    shape = numpy.broadcast_shapes(*(numpy.shape(c) for c in (ctr1, ctr2, ctr3)))
    streams = zip(*(numpy.broadcast_to(numpy.asarray(c, dtype=numpy.uint64), shape).reshape(-1).tolist()
                    for c in (ctr1, ctr2, ctr3)))
    out = numpy.empty((int(numpy.prod(shape)), len(starts), width), bool if at_least is not None else numpy.uint16)
    for j, (w1, w2, w3) in enumerate(streams):
        bits, at = None, 0                                  # `at`: the block the generator draws next
        for i, start in enumerate(starts):
            b0, b1 = _blocks(start, start + width)
            if bits is None or b0 < at:
                counter = ((w3 << 192 | w2 << 128 | w1 << 64 | b0) - 1) % (1 << 256)   # numpy adds 1 first
                bits = numpy.random.Philox(counter=counter, key=key[0] | key[1] << 64)
            elif b0 > at:
                bits.advance(b0 - at)
            skip = start - b0 * WORDS_PER_BLOCK
            words = bits.random_raw(4 * (b1 - b0)).astype("<u8", copy=False).view("<u2")[skip:skip + width]
            at = b1
            if at_least is None:
                out[j, i] = words
            else:
                numpy.greater_equal(words, numpy.uint16(at_least), out=out[j, i])
    return out.reshape(*shape, len(starts), width)


def _generic_rows(key, ctr1, ctr2, ctr3, starts, width: int, xp):
    """`stream_rows` by `philox4x64` on xp arrays, every row of every stream at once."""
    first = numpy.asarray(starts, dtype=numpy.int64) // WORDS_PER_BLOCK
    n = max(_blocks(s, s + width)[1] - b for s, b in zip(starts, first.tolist()))
    ctr0 = xp.asarray(first.astype(numpy.uint64))[:, None] + xp.arange(n, dtype=xp.uint64)   # (rows, blocks)
    ctr1, ctr2, ctr3 = (xp.asarray(c, dtype=xp.uint64)[..., None, None] for c in (ctr1, ctr2, ctr3))
    out = xp.stack(philox4x64(ctr0, ctr1, ctr2, ctr3, key, xp), axis=-1)    # (..., rows, blocks, 4)
    words = out.reshape(*out.shape[:-2], -1).view(xp.uint16)                # (..., rows, 16 blocks)
    skip = xp.asarray(numpy.asarray(starts, dtype=numpy.int64) - first * WORDS_PER_BLOCK)
    cols = skip[:, None] + xp.arange(width)                                 # (rows, width)
    return xp.take_along_axis(words, xp.broadcast_to(cols, words.shape[:-1] + (width,)), axis=-1)
