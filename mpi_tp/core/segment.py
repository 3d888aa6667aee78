"""Rows summed by key without atomics: the embedding's backward, the same sums on every backend.

    out[v] = sum of values[j] over the rows j with keys[j] == v       v = 0 ... n-1; 0 where none

numpy.add.at and cupyx.scatter_add add each row into its key's row in turn; on a GPU those
additions race (float atomics), so their order, and the rounding, change from run to run, and a
run resumed from a checkpoint is not bitwise the one that never stopped. Here the rows are sorted
by key with a stable sort (a key's rows keep their order), each key's run of rows is summed
pairwise, level by level, and each sum is written once, to its own row of `out`:

    level 1   r0 + r1,  r2 + r3,  r4             r0, r1, ... one key's rows, in their order
    level 2   (r0 + r1) + (r2 + r3),  r4         an odd last row is carried up unchanged
    level 3   ((r0 + r1) + (r2 + r3)) + r4       ceil(log2 R) levels for a key with R rows

A key's sum depends on its own rows and their order only: not on the other keys' rows, nor on
where its rows sit, nor on the backend (the same additions in the same order, each one rounded).
Its error grows as log R (pairwise summation), add.at's as R. The work is one sort of the N keys
and, per level, a gather of the rows still unsummed: at most two in three of the level before
(a run of 3 rows leaves 2), so O(N) rows in all, in ceil(log2 R_max) + 1 levels. On a GPU each
level waits for the device twice (the sizes of the rows done and of the rows left: 6 syncs for
uniform ids over V = 50257 at N = 8192, 24 for text-like ones), and uses no atomics.
Measured against numpy.add.at and a one-hot GEMM: experiments/kernels/README.md (segment_sum.py).
"""
from __future__ import annotations

from mpi_tp.core.backend import array_module


def segment_sum(keys, values, n: int):
    """out (n, ...) with out[v] the pairwise sum of the rows of `values` whose key is v (0 if none).

    keys (N,) integers in [0, n); values (N, ...) -> out (n, ...) in values' dtype.
    """
    xp = array_module(values)
    out = xp.zeros((n, *values.shape[1:]), dtype=values.dtype)
    order = xp.argsort(keys, kind="stable")               # a key's rows together, in their order
    keys, rows = keys[order], values[order]                # (N,), (N, ...)
    while keys.shape[0] > 0:
        N = keys.shape[0]
        last = xp.ones(N, dtype=bool)                      # (N,) the last row of its key's run
        last[:-1] = keys[1:] != keys[:-1]
        place = xp.arange(N) - xp.searchsorted(keys, keys)   # (N,) 0, 1, ... within its run
        single = (place == 0) & last                       # (N,) a run of one row: its key's sum
        done = xp.flatnonzero(single)
        out[keys[done]] = rows[done]                       # distinct keys: no two writes meet
        left = xp.flatnonzero((place % 2 == 0) & ~single)  # (N',) each pair's left row, or an odd last row
        right = xp.minimum(left + 1, N - 1)                # (N',) its right neighbour, where it has one
        paired = (~last[left]).reshape(-1, *(1,) * (rows.ndim - 1))   # its right neighbour is in its run
        carried = rows[left]                               # (N', ...) fresh
        keys, rows = keys[left], xp.where(paired, carried + rows[right], carried)
    return out


def segment_sum_naive(keys, values, n: int):
    """The same sums, one key at a time in Python, for the tests: the order segment_sum promises."""
    xp = array_module(values)
    out = xp.zeros((n, *values.shape[1:]), dtype=values.dtype)
    for v in range(n):
        rows = [values[j] for j in range(keys.shape[0]) if int(keys[j]) == v]
        while len(rows) > 1:                               # one level: pairs in order, an odd last row carried
            rows = [rows[i] + rows[i + 1] if i + 1 < len(rows) else rows[i] for i in range(0, len(rows), 2)]
        if rows:
            out[v] = rows[0]
    return out
