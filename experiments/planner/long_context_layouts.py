"""The cost model and the planner against published runs of today's shapes (Llama 3, SwiGLU, grouped-query
attention, FlashAttention) on H100s, with and without context parallelism (experiments/planner/published/
long_context_runs.json: Llama 3 405B's three pre-training stages, NeMo 24.07's Llama 3 70B at cp 2 in FP8,
NVIDIA's DGX Cloud recipes for Llama 3.1 8B, 70B and 405B at cp 2 in BF16).

    python experiments/planner/long_context_layouts.py      # a markdown table on stdout (docs/costmodel.md has it)

For each row the dgx-h100 preset (GEMM rate and peak doubled for an FP8 run: gemm_scale; TP collectives overlapped
where the run overlapped them: tp_overlap) prices the published (t, cp, p) twice: "as run", with the source's own
settings (v, recompute, zero: null where it does not say) and the rest at the planner's best (fitting in 80 GB if
any setting does), and at the planner's best for that (t, cp, p) that fits in 80 GB; TFLOP/s per GPU are model
FLOPs (the attention's whole square, PaLM's count, which Meta cites; NVIDIA's too). "rank" is the place of the
published (t, cp, p) among the planner's distinct triples, each at its best predicted time, in its whole search.
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
        mine, nodes = (row["t"], row["cp"], row["p"]), row["gpus"] // m.ranks_per_node
        search = dict(micro_only=1, overlap_tp=bool(row["tp_overlap"]))
        triples, best = [], None
        for x in plan(m, w, nodes, top=10**9, **search)["ranked"]:
            lay = x["layout"]
            key = (lay.tp, lay.cp, lay.pp)
            if key not in triples:
                triples.append(key)
            if best is None and key == mine:
                best = x
        # as run: the published settings pinned (its schedules: 1F1B and interleaved), what the source leaves open
        # at the planner's best that fits, or, where none fits (the run did), the fastest, the least memory first
        pins = dict(search, tp=row["t"], pp=row["p"], cp_only=row["cp"], schedules=("1f1b", "interleaved"))
        if row["v"] and row["v"] > 1:
            pins["virtual"] = row["v"]
        for key, name in (("recompute", "recomputes"), ("zero", "zeros")):
            if row[key] is not None:
                pins[name] = (row[key],)
        pinned = plan(m, w, nodes, top=1, **pins)
        as_run = (pinned["ranked"] or sorted(pinned["all"], key=lambda x: (x["time"]["total"],
                                                                         x["memory"]["total"])))[0]
        r = {"name": row["name"], "gpus": row["gpus"], "published": row["tflops_per_gpu"], "layout": mine,
             "rank": triples.index(mine) + 1 if mine in triples else None, "first": triples[:3],
             "as_run": as_run["layout"].describe(), "as_run_gb": as_run["memory"]["total"] / 1e9,
             "as_run_tflops": flops(m, w, as_run)}
        r["as_run_error"] = r["as_run_tflops"] / row["tflops_per_gpu"] - 1
        if best is not None:
            r.update(best=best["layout"].describe(), step_s=best["time"]["total"],
                     memory_gb=best["memory"]["total"] / 1e9,
                     predicted=flops(m, w, best), cp_s=best["time"]["cp_comm"], bubble_s=best["time"]["bubble"])
            r["error"] = r["predicted"] / row["tflops_per_gpu"] - 1
        out.append(r)
    return out


def flops(m, w, priced: dict) -> float:
    """A priced row's model TFLOP/s per GPU."""
    return achieved(m, w, priced["layout"], priced["time"]["total"])["flops_per_rank"] / 1e12


def main(results: list[dict] | None = None):
    """The markdown table of compare()'s rows (computed here unless given)."""
    print("| run | GPUs | published t, cp, p | TFLOP/s per GPU published | as run (the source's settings) | predicted "
          "| error | GB | the best of (t, cp, p) in 80 GB | predicted | error | step s (cp, bubble) | rank | planner's "
          "first (t, cp, p) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results if results is not None else compare():
        first = ", ".join(f"({t}, {c}, {p})" for t, c, p in r["first"])
        t, c, p = r["layout"]
        run = (f"{r['as_run']} | {r['as_run_tflops']:.0f} | {100 * r['as_run_error']:+.1f}% | {r['as_run_gb']:.0f}")
        if "predicted" not in r:
            print(f"| {r['name']} | {r['gpus']} | {t}, {c}, {p} | {r['published']} | {run} | does not fit | | | - "
                  f"| {first} |")
            continue
        print(f"| {r['name']} | {r['gpus']} | {t}, {c}, {p} | {r['published']} | {run} | {r['best']} "
              f"| {r['predicted']:.0f} | {100 * r['error']:+.1f}% | {r['step_s']:.2f} ({r['cp_s']:.2f}, "
              f"{r['bubble_s']:.2f}) | {r['rank']} | {first} |")


if __name__ == "__main__":
    main()
