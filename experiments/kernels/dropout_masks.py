"""Time to draw one layer's attention-dropout masks, before and after counter-based (Philox) masks.

    OMP_NUM_THREADS=1 python experiments/kernels/dropout_masks.py          # --batch 8 --heads 4 --seq 256 --p 0.1

One layer's attention-probability masks (B, H, S, S) at T = 1, three ways, and for scale the two
attention GEMMs (q k^T and probs v at head size hs) and the elementwise product that applies a mask:

- before: what mpi_tp drew until the masks were keyed by counter, a numpy Generator per head and
  sequence (keyed by (seed, step, layer + 1, site, head, row)), kept as float32 0 or 1/(1-p);
- now: Dropout.head_masks (mpi_tp.model.dropout), numpy's C Philox by counter, bool;
- generic: the same bits by philox.generic_words, the uint64 arithmetic that runs on CuPy, here
  on NumPy (only a check that the device path is not absurd: it is meant for a GPU).

Each time is the median (and the fastest) of --repeats calls after one warm-up, the cases taking
turns. No MPI.
"""
import argparse
import statistics
import time

import numpy as np

from mpi_tp.core import philox
from mpi_tp.core.runtime import cpu_name
from mpi_tp.model.dropout import Dropout, site_word


def before(B, H, S, p, seed, step, layer):
    """The masks as drawn before (the old Dropout.head_masks and Dropout.mask, line for line): one
    numpy Generator per (head, sequence), float32 0 or 1/(1-p)."""
    def mask(head):
        rows = []
        for b in range(B):
            key = [seed, step, layer + 1, 1, head, b]
            rows.append(np.random.default_rng(key).random((S, S)) >= p)
        return np.stack(rows).astype(np.float32) / (1.0 - p)
    return np.stack([mask(h) for h in range(H)], axis=1)


def timings_ms(fns, repeats):
    """Median and fastest of `repeats` calls of each fn, the fns taking turns (a shared machine's
    load then weighs on all of them alike)."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()                                                     # warm-up
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            fn()
            t.append(1e3 * (time.perf_counter() - start))
    return [(statistics.median(t), min(t)) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hs", type=int, default=64, help="head size, for the GEMMs")
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    B, H, S, hs = a.batch, a.heads, a.seq, a.hs
    drop = Dropout(a.p, 1337)
    drop.step = 5
    drop = drop.masks()                                   # this step's masks (model.dropout.Masks)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, S, hs), dtype=np.float32) for _ in range(3))
    probs = rng.random((B, H, S, S), dtype=np.float32)
    old, new = before(B, H, S, a.p, 1337, 5, 0), drop.head_masks(B, S, range(H), 0)
    key, rows, sites = philox.split_key(1337), np.arange(B)[:, None], site_word(0, 1, np.arange(H))[None, :]

    def generic():
        return (philox.generic_words(key, rows, sites, 5, 0, S * S) >= drop.threshold).reshape(B, H, S, S)
    assert np.array_equal(generic(), new), "the generic Philox drew other masks"
    runs = [
        ("before: Generator per head and sequence, float32", lambda: before(B, H, S, a.p, 1337, 5, 0), old),
        ("now: Philox by counter (numpy), bool", lambda: drop.head_masks(B, S, range(H), 0), new),
        ("generic Philox (the CuPy arithmetic) on numpy", generic, None),
        ("two attention GEMMs (q k^T, probs v)", lambda: (q @ k.swapaxes(-1, -2), probs @ v), None),
        ("probs * mask, float32 mask (before)", lambda: probs * old, None),
        ("probs * mask, bool mask (now)", lambda: probs * new, None),
        ("numpy Philox alone, 16 bits per element", lambda: raw(B * H * S * S // 4), None),
        ("numpy Philox alone, 32 bits per element", lambda: raw(B * H * S * S // 2), None),
    ]
    print(f"B {B}, H {H}, S {S}, hs {hs}, p {a.p}: median (fastest) of {a.repeats}, {cpu_name()}")
    print(f"{'':52s} {'median ms':>9s} {'fastest':>8s} {'MiB':>6s}")
    for (name, _, mask), (med, fast) in zip(runs, timings_ms([fn for _, fn, _ in runs], a.repeats)):
        mib = f"{mask.nbytes / 2**20:6.1f}" if mask is not None else ""
        print(f"{name:52s} {med:9.2f} {fast:8.2f} {mib:>6s}")


_BITS = np.random.Philox(counter=0, key=1)


def raw(n):
    """n 64-bit outputs of numpy's Philox: the bits of 4 n elements at 16 bits, of 2 n at 32."""
    return _BITS.random_raw(n)


if __name__ == "__main__":
    main()
