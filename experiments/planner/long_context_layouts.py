"""The cost model and the planner against published runs of today's shapes (Llama 3, SwiGLU, grouped-query
attention, FlashAttention) on H100s, with and without context parallelism (experiments/planner/published/
long_context_runs.json: Llama 3 405B's three pre-training stages, NeMo 24.07's Llama 3 70B at cp 2).

    python experiments/planner/long_context_layouts.py      # a markdown table on stdout (docs/costmodel.md has it)

For each row the dgx-h100 preset (GEMM rate and peak doubled for an FP8 run: gemm_scale) prices the published
(t, cp, p) with what the source leaves open (micro-batch 1; virtual stages, recomputation, sequence parallelism and
ZeRO) at the planner's best that fits in 80 GB, and counts its TFLOP/s per GPU as model FLOPs (the attention's
whole square, PaLM's count, which Meta cites; NeMo's too); "rank" is the place of the published (t, cp, p) among
the planner's distinct triples, each at its best predicted time, in the planner's whole search of that many GPUs.
"""
import json
import os
import sys
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from mpi_tp.planning.costmodel import achieved                # noqa: E402
from mpi_tp.planning.machines import PRESETS                   # noqa: E402
from mpi_tp.planning.planner import plan                       # noqa: E402
from mpi_tp.planning.workload import Workload                  # noqa: E402

RUNS = os.path.join(HERE, "published", "long_context_runs.json")


def rows(path=RUNS) -> list[dict]:
    with open(path) as f:
        table = json.load(f)
    return [dict(zip(table["columns"], row)) for row in table["rows"]]


def machine_of(row):
    m, k = PRESETS["dgx-h100"], row["gemm_scale"]
    return replace(m, gemm_flops=m.gemm_flops * k, peak_flops=m.peak_flops * k) if k != 1 else m


def workload_of(row) -> Workload:
    return Workload(row["layers"], row["hidden"], row["heads"], row["seq"], row["global_batch"], vocab=row["vocab"],
                    arch="llama", n_kv_head=row["kv_heads"], intermediate_size=row["ffn"], attention="flash")


def compare(path=RUNS) -> list[dict]:
    out = []
    for row in rows(path):
        m, w = machine_of(row), workload_of(row)
        result = plan(m, w, row["gpus"] // m.ranks_per_node, top=10**9, micro_only=1)
        triples, best = [], None
        for x in result["ranked"]:
            lay = x["layout"]
            key = (lay.tp, lay.cp, lay.pp)
            if key not in triples:
                triples.append(key)
            if best is None and key == (row["t"], row["cp"], row["p"]):
                best = x
        mine = (row["t"], row["cp"], row["p"])
        r = {"name": row["name"], "gpus": row["gpus"], "published": row["tflops_per_gpu"], "layout": mine,
             "rank": triples.index(mine) + 1 if mine in triples else None, "first": triples[:3]}
        if best is not None:
            seconds = best["time"]["total"]
            r.update(best=best["layout"].describe(), step_s=seconds, memory_gb=best["memory"]["total"] / 1e9,
                     predicted=achieved(m, w, best["layout"], seconds)["flops_per_rank"] / 1e12,
                     cp_s=best["time"]["cp_comm"], bubble_s=best["time"]["bubble"])
            r["error"] = r["predicted"] / row["tflops_per_gpu"] - 1
        out.append(r)
    return out


def main():
    print("| run | GPUs | published t, cp, p | TFLOP/s per GPU published | predicted | error | its best settings "
          "| step s (cp, bubble) | GB per GPU | rank of (t, cp, p) | planner's first (t, cp, p) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in compare():
        first = ", ".join(f"({t}, {c}, {p})" for t, c, p in r["first"])
        t, c, p = r["layout"]
        if "predicted" not in r:
            print(f"| {r['name']} | {r['gpus']} | {t}, {c}, {p} | {r['published']} | does not fit | | | | | - | {first} |")
            continue
        print(f"| {r['name']} | {r['gpus']} | {t}, {c}, {p} | {r['published']} | {r['predicted']:.0f} "
              f"| {100 * r['error']:+.1f}% | {r['best']} | {r['step_s']:.2f} ({r['cp_s']:.2f}, {r['bubble_s']:.2f}) "
              f"| {r['memory_gb']:.0f} | {r['rank']} | {first} |")


if __name__ == "__main__":
    main()
