"""The embedding's backward three ways: numpy.add.at, the sorted segment sum, a one-hot GEMM.

    python experiments/kernels/segment_sum.py                     # N = B S = 8 x 1024 tokens, C = 256 and 1024
    python experiments/kernels/segment_sum.py --onehot-max-gib 4  # also time the one-hot GEMM at V = 50257

For V = 256 and 50257 and token ids drawn uniformly or Zipf-like (a few ids take most rows, as in
text), times dwte (V, C) from dout (N, C): add.at (the old CPU path; cupyx.scatter_add's float
atomics were the GPU one), mpi_tp.core.segment.segment_sum (the new path on every backend), and
onehot(ids) (V, N) @ dout (N, C), skipped when the one-hot matrix would pass --onehot-max-gib.
Best of --repeats, float32, one thread (OMP_NUM_THREADS=1); then, on other float64 values, the
largest difference from add.at over each row's sum of |terms| (the summation orders differ).
Prints a table (experiments/kernels/README.md has one).
"""
import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from mpi_tp.core.runtime import cpu_name  # noqa: E402
from mpi_tp.core.segment import segment_sum  # noqa: E402


def add_at(ids, dout, V):
    out = np.zeros((V, dout.shape[1]), dtype=dout.dtype)
    np.add.at(out, ids, dout)
    return out


def onehot(ids, dout, V):
    return (np.arange(V)[:, None] == ids[None, :]).astype(dout.dtype) @ dout    # (V, N) @ (N, C) -> (V, C)


def best_ms(f, repeats, *args):
    f(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def draw_ids(rng, kind, V, N):
    if kind == "uniform":
        return rng.integers(0, V, N)
    return (rng.zipf(1.2, N) - 1) % V                    # id 0 takes about a third of the rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 1024, help="N = B S")
    ap.add_argument("--channels", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--vocab", type=int, nargs="+", default=[256, 50257])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--onehot-max-gib", type=float, default=1.0)
    args = ap.parse_args()
    N, rng = args.tokens, np.random.default_rng(0)
    print(f"{cpu_name()}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, numpy {np.__version__}, N = {N}")
    print(f"{'ids':>8} {'V':>6} {'C':>5} {'longest':>7} | {'add.at ms':>9} {'segment ms':>10} {'one-hot ms':>10}"
          f" | {'f64 err segment':>15} {'f64 err one-hot':>15}")
    for kind in ("uniform", "zipf"):
        for V in args.vocab:
            ids = draw_ids(rng, kind, V, N)
            longest = int(np.bincount(ids).max())
            gib = V * N * 4 / 2**30
            for C in args.channels:
                dout = rng.standard_normal((N, C)).astype(np.float32)
                t_at = best_ms(add_at, args.repeats, ids, dout, V)
                t_seg = best_ms(segment_sum, args.repeats, ids, dout, V)
                d64 = rng.standard_normal((N, C))             # float64 values: float32 ones would sum exactly
                scale = np.maximum(add_at(ids, np.abs(d64), V), 1e-300)
                want = add_at(ids, d64, V)
                e_seg = float((np.abs(segment_sum(ids, d64, V) - want) / scale).max())
                if gib <= args.onehot_max_gib:
                    t_hot = f"{best_ms(onehot, args.repeats, ids, dout, V):10.1f}"
                    e_hot = f"{float((np.abs(onehot(ids, d64, V) - want) / scale).max()):15.1e}"
                else:
                    t_hot, e_hot = f"{f'({gib:.1f} GiB)':>10}", f"{'-':>15}"
                print(f"{kind:>8} {V:6d} {C:5d} {longest:7d} | {t_at:9.1f} {t_seg:10.1f} {t_hot} | "
                      f"{e_seg:15.1e} {e_hot}", flush=True)


if __name__ == "__main__":
    main()
