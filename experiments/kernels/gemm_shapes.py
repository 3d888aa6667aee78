"""The model's matrix products, one core, by library and layout (issue 26): what mpi_tp.core.blas and
kernels._few_rows chose from.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python experiments/kernels/gemm_shapes.py

Training (N = 1024 rows, the shapes a, b and c of mpi-tp bench: (K, O) = (C, 3C), (C, C), (C, 4C),
(4C, C)): GFLOP/s of the forward x @ w, the input gradient dout @ w^T and the weight gradient x^T dout,
by NumPy (OpenBLAS), MKL (mpi_tp.core.blas, when the mkl wheel is installed) and PyTorch (torch.mm,
when torch is installed: the peer's library). Decoding (C 1024: weights (1024, 3072), (4096, 1024),
(1024, 4096); 1 to 32 rows): milliseconds of x @ w with the weight stored (in, out), stored (out, in)
as one call (w_t @ x^T), by panels (kernels._few_rows), and by MKL, each product on the next of copies
of the weight (96 MiB of them in each layout, twice the 48 MB L3: read from memory, as in a model).
Medians of 15 runs; one JSON line per measurement in experiments/kernels/results/gemm_shapes.jsonl (rewritten),
the machine named; the tables print as Markdown. A shared machine is noisy: compare within one run.
"""
import itertools
import json
import os
import statistics
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from mpi_tp.core import blas  # noqa: E402
from mpi_tp.core.kernels import _few_rows  # noqa: E402
from mpi_tp.core.runtime import machine_text  # noqa: E402

OUT = os.path.join(HERE, "results", "gemm_shapes.jsonl")


def median_s(fn, reps=15):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def libraries():
    """{name: matmul(a, b)} of the libraries installed here."""
    out = {"numpy": numpy.matmul}
    os.environ["MPI_TP_BLAS"] = "mkl"
    try:
        blas._mkl = None
        blas.which()
        out["mkl"] = blas.matmul
    except Exception:                                   # noqa: BLE001 (no mkl wheel: not measured)
        pass
    try:
        import torch
        torch.set_num_threads(1)
        out["torch"] = lambda a, b: torch.mm(torch.from_numpy(a), torch.from_numpy(b))
    except ImportError:
        pass
    return out


def training(libs, rows):
    print("\n| C | (K, O) | " + " | ".join(f"{n} fwd / dX / dW GFLOP/s" for n in libs) + " |")
    print("|---|---|" + "---|" * len(libs))
    rng = numpy.random.default_rng(0)
    for C in (256, 512, 1024):
        for K, O in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):
            x, w = rng.random((1024, K), dtype=numpy.float32), rng.random((K, O), dtype=numpy.float32)
            d = rng.random((1024, O), dtype=numpy.float32)
            cells = []
            for name, mm in libs.items():
                rates = [2 * 1024 * K * O / median_s(lambda a=a, b=b: mm(a, b)) / 1e9 for a, b in
                         ((x, w), (d, w.T), (x.T, d))]
                rows.append({"kind": "training", "library": name, "K": K, "O": O, "gflops": rates})
                cells.append(" / ".join(f"{r:.0f}" for r in rates))
            print(f"| {C} | ({K}, {O}) | " + " | ".join(cells) + " |")


COLD_BYTES = 192 * 2 ** 20     # decoding's copies of a weight, both layouts together: 96 MiB per layout, past L3


def decoding(libs, rows):
    """Each product on the next of several copies of the weight (COLD_BYTES / 2 in its layout): a decode step
    reads ~100 MB of weights once, from memory; one weight of 12-16 MB timed again and again would sit in a
    48 MB L3 and read faster than any model step can."""
    forms = {"(in, out): x @ w": lambda x, w, wt, xt: x @ w,
             "(out, in), one call": lambda x, w, wt, xt: wt @ xt,
             "(out, in), panels (_few_rows)": lambda x, w, wt, xt: _few_rows(x, wt)}
    if "mkl" in libs:
        forms["(out, in), MKL"] = lambda x, w, wt, xt: blas.matmul(wt, xt)
    print("\n| weight (K, O) | rows | " + " | ".join(f"{f} ms" for f in forms) + " |")
    print("|---|---|" + "---|" * len(forms))
    rng = numpy.random.default_rng(1)
    for K, O in ((1024, 3072), (4096, 1024), (1024, 4096)):
        w = rng.random((K, O), dtype=numpy.float32)
        copies = [(w.copy(), numpy.ascontiguousarray(w.T)) for _ in range(max(1, COLD_BYTES // (2 * w.nbytes)))]
        for n in (1, 2, 4, 8, 16, 32):
            x = rng.random((n, K), dtype=numpy.float32)
            xt = numpy.ascontiguousarray(x.T)
            turn = itertools.cycle(copies)
            ms = {f: 1e3 * median_s(lambda f=f: forms[f](x, *next(turn), xt)) for f in forms}
            rows.append({"kind": "decoding", "K": K, "O": O, "rows": n, "ms": ms,
                         "weights_cycled_mib": COLD_BYTES >> 20})
            print(f"| ({K}, {O}) | {n} | " + " | ".join(f"{v:.2f}" for v in ms.values()) + " |")


def main():
    libs, rows = libraries(), []
    print(f"{machine_text()}; one thread; float32; {time.strftime('%Y-%m-%d %H:%M')}; "
          f"command: python experiments/kernels/gemm_shapes.py")
    training(libs, rows)
    decoding(libs, rows)
    write_rows(OUT, rows)


def write_rows(path, rows):
    """The measurements as JSON lines (the file rewritten), each with the machine and the date."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"machine": machine_text(), "date": time.strftime("%Y-%m-%d %H:%M"), **r}) + "\n")
    print(f"\nraw: {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
