"""Causal attention's forms, one core (issue 26): time and kept memory, float32, hs 64.

    OMP_NUM_THREADS=1 python experiments/kernels/attention_forms.py

1. The backward a few batch rows at a time (kernels_attention._batch_rows, CHUNK_BYTES of probabilities
   per chunk) against the whole batch at once, at the training shapes' S = 128: (B, H) = (8, 4) (shape
   a), (8, 8) (b), (4, 16) (c).
2. The blocked form (query blocks of 128, the (B, H, S, S) probabilities kept) against the online
   softmax (tiles of 128 x 128, out and lse kept; what the model runs from ONLINE_FROM positions), from
   S = 256 to 4096 at B H = 16: forward and backward ms, and the bytes each keeps for the backward.

Medians of 5 runs (3 from S = 2048); one JSON line per measurement in
experiments/kernels/results/attention_forms.jsonl (rewritten); Markdown tables printed with the machine.
"""
import os
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from gemm_shapes import median_s, write_rows  # noqa: E402
from mpi_tp.core import kernels_attention as ka  # noqa: E402
from mpi_tp.core import kernels_online as ko  # noqa: E402
from mpi_tp.core.runtime import keep_freed_memory, machine_text  # noqa: E402

OUT = os.path.join(HERE, "results", "attention_forms.jsonl")


def ms(fn, reps):
    return 1e3 * median_s(fn, reps)


def qkvd(B, H, S, seed=0):
    rng = numpy.random.default_rng(seed)
    return [rng.standard_normal((B, H, S, 64)).astype(numpy.float32) for _ in range(4)]


def chunked(rows):
    print("\n| (B, H, S) | backward, whole batch ms | by batch rows ms | ratio |\n|---|---|---|---|")
    for B, H in ((8, 4), (8, 8), (4, 16)):
        q, k, v, d = qkvd(B, H, 128)
        cache = ka.attention_forward(q, k, v)[1]
        got = {}
        for name, chunk in (("whole", 1 << 40), ("rows", ka.CHUNK_BYTES)):
            saved, ka.CHUNK_BYTES = ka.CHUNK_BYTES, chunk
            got[name] = ms(lambda: ka.attention_backward(d, cache), 15)
            ka.CHUNK_BYTES = saved
        rows.append({"part": "backward by rows", "B": B, "H": H, "S": 128, "ms": got})
        print(f"| ({B}, {H}, 128) | {got['whole']:.2f} | {got['rows']:.2f} | {got['rows'] / got['whole']:.2f} |")


def forms(rows):
    print("\n| S | (B, H) | blocked fwd / bwd ms | online fwd / bwd ms | kept MiB blocked / online |"
          "\n|---|---|---|---|---|")
    for S, B, H in ((256, 2, 8), (512, 2, 8), (1024, 1, 16), (2048, 1, 16), (4096, 1, 16)):
        q, k, v, d = qkvd(B, H, S)
        reps = 5 if S < 2048 else 3
        got = {}
        for name, fwd, bwd in (("blocked", ka.attention_forward, ka.attention_backward),
                               ("online", ko.online_attention_forward, ko.online_attention_backward)):
            out, cache = fwd(q, k, v)
            kept = sum(a.nbytes for a in cache if isinstance(a, numpy.ndarray) and a is not q and a is not k
                       and a is not v)
            got[name] = (ms(lambda: fwd(q, k, v), reps), ms(lambda c=cache: bwd(d, c), reps), kept / 2 ** 20)
            del out, cache
        rows.append({"part": "forms", "B": B, "H": H, "S": S, "blocked": got["blocked"], "online": got["online"]})
        b, o = got["blocked"], got["online"]
        print(f"| {S} | ({B}, {H}) | {b[0]:.1f} / {b[1]:.1f} | {o[0]:.1f} / {o[1]:.1f} | {b[2]:.1f} / {o[2]:.2f} |")


def main():
    keep_freed_memory()
    rows = []
    print(f"{machine_text()}; one thread; float32; {time.strftime('%Y-%m-%d %H:%M')}; "
          f"command: python experiments/kernels/attention_forms.py")
    chunked(rows)
    forms(rows)
    write_rows(OUT, rows)


if __name__ == "__main__":
    main()
