"""The cost model and the planner against published layouts: Narayanan et al. 2021, Table 1, and other
published runs of 100B+ parameters (BLOOM-176B, MT-NLG 530B at three scales: experiments/planner/published/).

    python experiments/planner/published_layouts.py        # markdown tables on stdout (docs/costmodel.md has them)

For each row of experiments/planner/published/narayanan2021_table1.json (models of 1.7B
to 1T parameters on 32 to 3072 A100s, each with the t, p, micro-batch and
interleaving its authors ran), the dgx-a100 preset predicts the step time of the
published layout (full recomputation, no sequence parallelism or ZeRO, as in
2021) and its teraFLOP/s per GPU, counted as the paper counts them (eq. 3: the
recomputed forward included); and `plan` ranks every layout of that many GPUs:
"rank" is the place of the published (t, p) among the distinct (t, p) pairs,
each at its best predicted time (1: the planner's first choice, as `mpi-tp plan` numbers its rows),
among the schedules and ZeRO stages the runs had, without context parallelism (THEIR_SPACE), and
"rank_zb" the same in the planner's whole search (the zero-bubble schedules, ZeRO-2/3 and cp too).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from mpi_tp.planning.costmodel import Plan, Workload, achieved, step_time
from mpi_tp.planning.machines import PRESETS
from mpi_tp.planning.memory import memory_per_rank
from mpi_tp.planning.planner import plan

TABLE = os.path.join(HERE, "published", "narayanan2021_table1.json")
OTHERS = os.path.join(HERE, "published", "other_100b_runs.json")


def published_rows(path=TABLE) -> list[dict]:
    with open(path) as f:
        table = json.load(f)
    return [dict(zip(table["columns"], row)) for row in table["rows"]]


def layout_of(row) -> tuple[Workload, Plan]:
    w = Workload(row["layers"], row["hidden"], row["heads"], 2048, row["global_batch"], vocab=row.get("vocab", 51200),
                 attention=row.get("attention", "stored"))     # 2021-22: Megatron's softmax, the scores kept
    t, p = row["t"], row["p"]
    per_chunk = row["layers_per_virtual_stage"]
    virtual = row["layers"] // p // per_chunk if per_chunk else 1
    return w, Plan(tp=t, pp=p, dp=row["gpus"] // (t * p), micro_batch=row["micro_batch"], recompute=True,
                     virtual=virtual, zero=row.get("zero", 0))


# What the published runs could choose from: the schedules of their time (none split the backward into B and W)
# and at most ZeRO-1; the planner today also searches the zero-bubble schedules and ZeRO-2/3 ("rank_zb").
THEIR_SPACE = {"schedules": ("1f1b", "interleaved"), "zeros": (0, 1), "cp_only": 1}   # (no cp before 2023)


def _rank(m, w, lay, gpus, even_stages, **space) -> tuple:
    """(rank of (lay.tp, lay.pp) among the planner's distinct pairs at their best times, the first five pairs,
    how much slower the pair's best is than the first's: a fraction)."""
    pairs, times = [], []
    for x in plan(m, w, gpus // m.ranks_per_node, top=10**9, even_stages=even_stages, **space)["ranked"]:
        pair = (x["layout"].tp, x["layout"].pp)
        if pair not in pairs:
            pairs.append(pair)
            times.append(x["time"]["total"])
    if (lay.tp, lay.pp) not in pairs:
        return None, pairs[:5], None
    k = pairs.index((lay.tp, lay.pp))
    return k + 1, pairs[:5], times[k] / times[0] - 1


def compare(m=PRESETS["dgx-a100"], rank_layouts=True, path=TABLE, even_stages=True) -> list[dict]:
    """Each published row priced, and (rank_layouts) the rank of its (t, p) among the planner's distinct pairs,
    in the runs' own space (THEIR_SPACE: rank, planner_pairs) and in the planner's whole search (rank_zb,
    planner_pairs_zb); even_stages: search only stage counts that divide the layers (Table 1's authors' space)."""
    out = []
    for row in published_rows(path):
        w, lay = layout_of(row)
        seconds = step_time(m, w, lay)["total"]
        predicted = achieved(m, w, lay, seconds)["hardware_flops_per_rank"] / 1e12
        r = {"name": row["name"], "t": lay.tp, "p": lay.pp, "dp": lay.dp, "b": lay.micro_batch, "v": lay.virtual,
             "gpus": row["gpus"], "published": row["tflops_per_gpu"], "predicted": predicted,
             "error": predicted / row["tflops_per_gpu"] - 1, "step_s": seconds,
             "memory_gb": memory_per_rank(m, w, lay)["total"] / 1e9, "rank": None, "planner_pairs": [],
             "rank_zb": None, "planner_pairs_zb": []}
        if rank_layouts:
            r["rank"], r["planner_pairs"], r["behind"] = _rank(m, w, lay, row["gpus"], even_stages, **THEIR_SPACE)
            r["rank_zb"], r["planner_pairs_zb"], _ = _rank(m, w, lay, row["gpus"], even_stages)
        out.append(r)
    return out


def main():
    for path, even, title in ((TABLE, True, "Narayanan et al. 2021, Table 1 (ranked among even stages)"),
                              (OTHERS, False, "other published runs (ranked among every layout the engine trains)")):
        print(f"\n{title}\n")
        print("| model | GPUs | published t, p, b, v | TFLOP/s per GPU published | predicted | error | GB per GPU "
              "| rank of (t, p) | planner's first (t, p) | rank with zb, ZeRO-2/3 | planner's first (t, p) then |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in compare(path=path, even_stages=even):
            first, first_zb = (", ".join(f"({t}, {p})" for t, p in r[k][:3]) for k in ("planner_pairs", "planner_pairs_zb"))
            print(f"| {r['name']} | {r['gpus']} | {r['t']}, {r['p']}, {r['b']}, {r['v']} | {r['published']} "
                  f"| {r['predicted']:.0f} | {100 * r['error']:+.1f}% | {r['memory_gb']:.0f} | {r['rank']} | {first} "
                  f"| {r['rank_zb']} | {first_zb} |")


if __name__ == "__main__":
    main()
