"""The tables of docs/performance.md, printed from the raw results that experiments/bench/bench_results.sh writes.

    python experiments/bench/bench_tables.py                      # experiments/bench/results/
    python experiments/bench/bench_tables.py --results DIR

Prints three Markdown tables: step times at T = 1 and T = 2 (bench_t1.jsonl,
bench_t2.jsonl), the hidden size x sequence length sweep (sweep_t1.jsonl), and
glibc's defaults against freed memory kept (malloc.jsonl), each with the
machine and date the lines record. Nothing is typed in by hand.
"""
import argparse
import json
import os
import statistics

SHAPES = {(256, 4, 4, 128, 8): "a", (512, 8, 4, 128, 8): "b", (1024, 16, 2, 128, 4): "c"}


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def key(r):
    s = r["shape"]
    return s["n_embd"], s["n_head"], s["n_layer"], s["block_size"], s["batch"]


def stamp(rs):
    e = rs[0]["environment"]
    return (f"{e['cpu']}, {e['cores']} cores, BLAS {e['blas'].get('internal_api')} {e['blas'].get('version')} "
            f"({e['blas'].get('architecture')}), {' '.join(e['mpi'].replace('Version:', '').split())}, numpy {e['numpy']}, "
            f"{rs[0]['environment']['date'][:10]}")


def results_table(r1, r2):
    print(f"Machine: {stamp(r1)}.\n")
    print("| shape | T | step ms | tokens/s | model GFLOP/s per rank | GEMM peak per rank | fraction | "
          "fwd / bwd / opt ms | all-reduce ms | MB in collectives per step | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(r1 + r2, key=lambda r: (SHAPES.get(key(r), "?"), r["tp"])):
        p, comm = r["phases_ms"], sum(v for k, v in r["comm_ms"].items() if k.endswith("all_reduce"))
        print(f"| {SHAPES.get(key(r), key(r))} | {r['tp']} | {r['step_ms']['median']:.0f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_gflops_per_rank']:.1f} | {r['gemm_peak_gflops_per_rank']:.1f} | "
              f"{100 * r['fraction_of_gemm_peak']:.0f}% | {p['forward']:.0f} / {p['backward']:.0f} / "
              f"{p['optimizer']:.0f} | {comm:.1f} | {r['comm_bytes_per_step'] / 1e6:.1f} | "
              f"{r['peak_rss_mb_per_rank']:.0f} |")
    one = {key(r): r["step_ms"]["median"] for r in r1}
    ups = [f"{one[key(r)] / r['step_ms']['median']:.2f}x ({SHAPES.get(key(r), key(r))})" for r in r2 if key(r) in one]
    print(f"\nSpeed-up from T = 1 to T = 2: {', '.join(ups)}.\n")


def sweep_table(rs):
    print(f"Machine: {stamp(rs)}.\n")
    Cs = sorted({r["shape"]["n_embd"] for r in rs})
    Ss = sorted({r["shape"]["block_size"] for r in rs})
    cell = {(r["shape"]["n_embd"], r["shape"]["block_size"]): r for r in rs}
    print("| C \\ S | " + " | ".join(str(s) for s in Ss) + " |")
    print("|---" * (len(Ss) + 1) + "|")
    for C in Cs:
        out = []
        for S in Ss:
            r = cell.get((C, S))
            out.append("-" if r is None else f"{r['step_ms']['median']:.0f} ms, {r['model_gflop_per_step']:.1f} GF, "
                                             f"{100 * r['fraction_of_gemm_peak']:.0f}%")
        print(f"| {C} | " + " | ".join(out) + " |")
    print()


def malloc_table(rs):
    print(f"Machine: {stamp(rs)}.\n")
    print("| shape | glibc defaults, ms | freed memory kept, ms | kept / defaults | runs each |")
    print("|---|---|---|---|---|")
    for k in sorted({key(r) for r in rs}, key=lambda k: SHAPES.get(k, "?")):
        by = {kept: [r["step_ms"]["median"] for r in rs if key(r) == k and bool(r["environment"]["malloc"]) == kept]
              for kept in (False, True)}
        d, m = statistics.median(by[False]), statistics.median(by[True])
        print(f"| {SHAPES.get(k, k)} | {d:.0f} | {m:.0f} | {m / d:.2f} | {len(by[False])} |")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    at = lambda name: os.path.join(args.results, name)  # noqa: E731
    results_table(rows(at("bench_t1.jsonl")), rows(at("bench_t2.jsonl")))
    sweep_table(rows(at("sweep_t1.jsonl")))
    if os.path.isfile(at("malloc.jsonl")):
        malloc_table(rows(at("malloc.jsonl")))


if __name__ == "__main__":
    main()
