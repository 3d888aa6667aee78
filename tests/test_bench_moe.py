"""`mpi-tp bench --moe` end to end on a tiny shape at 1 and 2 ranks: its JSON fields, the all-to-all and
all-reduce bytes it counted equal to the formulas, and the load figures consistent (never a time).

These tests start their own MPI jobs, so they run in the one-rank pass only (no mpi marker).
"""
import json
import sys

import pytest
from jobs import MPIEXEC, run_job

from mpi_tp.parallel.topology import split_sizes

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
C, S, B = 32, 16, 2
TINY = ["bench", "--moe", "--custom", f"{C},2,1,{S},{B}", "--steps", "2", "--warmup", "1"]
MOE_FIELDS = ("dispatcher", "step_ms", "dispatch_ms", "compute_ms", "collectives_per_step", "all_to_allv_bytes_rank",
              "counts_bytes_rank", "collective_bytes_rank", "wire_bytes_rank", "bytes_per_token",
              "rows_per_expert_per_rank", "tokens_per_expert",
              "routed_per_expert", "imbalance", "routed_imbalance", "rank_imbalance", "dropped_fraction",
              "gflop_per_rank")
DENSE_FIELDS = ("width", "tp", "step_ms", "all_reduce_ms", "compute_ms", "all_reduce_bytes_rank",
                "wire_bytes_rank", "bytes_per_token", "gflop_per_rank")


def bench(n, tmp_path, *extra):
    out = tmp_path / f"moe_{n}.jsonl"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi_tp", *TINY, "--json", str(out), *extra]
    r = run_job(cmd, timeout=240)
    return r, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


@pytest.mark.parametrize("ranks,E,k,capacity", [(1, 4, 2, 0.0), (2, 4, 2, 0.0), (2, 3, 1, 0.5)],
                         ids=["1-rank", "2-ranks-dropless", "2-ranks-E3-top1-capacity"])
def test_bench_moe_fields_and_counters(tmp_path, ranks, E, k, capacity):
    r, rows = bench(ranks, tmp_path, "--moe-experts", str(E), "--moe-top-k", str(k), "--moe-capacity", str(capacity))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("MoE MLP C=32") == 1 and r.stdout.count("dense MLP of width") == 1   # rank 0 prints
    assert len(rows) == 1
    row = rows[0]
    m, d = row["moe"], row["dense"]
    assert all(f in m for f in MOE_FIELDS), sorted(set(MOE_FIELDS) - set(m))
    assert all(f in d for f in DENSE_FIELDS), sorted(set(DENSE_FIELDS) - set(d))
    assert (row["mode"], row["ranks"], row["ep"], row["dp"], row["experts"], row["top_k"]) == ("moe", ranks, ranks,
                                                                                             ranks, E, k)
    assert "environment" in row and set(m["step_ms"]) == {"median", "min", "max"}
    N = ranks * B * S
    assert row["tokens_per_step"] == N and d["width"] == k * 4 * C and d["tp"] == ranks
    # all-to-all: what the counters saw equals the routing's formula (rows out and back, 2 passes, float32)
    out, back = m["rows_out_back_rank"]
    assert m["all_to_allv_bytes_rank"]["measured"] == m["all_to_allv_bytes_rank"]["formula"] == \
        (2 * (out + back) * C * 4 if ranks > 1 else 0)
    assert m["counts_bytes_rank"]["measured"] == m["counts_bytes_rank"]["formula"] == \
        (ranks - 1) * max(split_sizes(E, ranks)) * 8
    calls = {key: v["calls"] for key, v in m["collectives_per_step"].items()}
    assert calls == ({"ep/all_to_all": 1, "ep/all_to_allv": 4} if ranks > 1 else {})
    assert all(v["measured"] == v["formula"] for v in m["collective_bytes_rank"].values())
    assert m["wire_bytes_rank"]["measured"] == m["wire_bytes_rank"]["formula"] == \
        m["all_to_allv_bytes_rank"]["measured"] + m["counts_bytes_rank"]["measured"]
    # dense: two all-reduces of (N, C) float32
    assert d["all_reduce_bytes_rank"]["measured"] == d["all_reduce_bytes_rank"]["formula"] == \
        (2 * N * C * 4 if ranks > 1 else 0)
    assert d["wire_bytes_rank"]["measured"] == d["wire_bytes_rank"]["formula"]
    assert d["all_reduce_calls"] == (2 if ranks > 1 else 0)
    # the load: every assignment routed, the admitted ones grouped by owner as split_sizes says
    assert sum(m["routed_per_expert"]) == N * k and len(m["tokens_per_expert"]) == E
    assert [len(per) for per in m["rows_per_expert_per_rank"]] == split_sizes(E, ranks)
    assert [n for per in m["rows_per_expert_per_rank"] for n in per] == m["tokens_per_expert"]
    assert abs(m["dropped_fraction"] - (1 - sum(m["tokens_per_expert"]) / (N * k))) < 1e-12
    assert m["routed_imbalance"] >= 1 and m["imbalance"] >= 1 and m["rank_imbalance"] >= 1
    if capacity:
        assert m["dropped_fraction"] > 0, "capacity 0.5 should drop something: the case proves nothing"
        cap = -(-int(capacity * S * k) // E)
        assert max(m["tokens_per_expert"]) <= cap * B * ranks
    else:
        assert m["dropped_fraction"] == 0 and m["tokens_per_expert"] == m["routed_per_expert"]


def test_bench_moe_refuses_other_modes(tmp_path):
    r, rows = bench(2, tmp_path, "--dp", "2")
    assert r.returncode == 2 and r.stderr.count("--moe runs ep = dp = ranks") == 1, r.stderr
    r, rows = bench(2, tmp_path, "--moe-experts", "1", "--moe-top-k", "1")
    assert r.returncode == 2 and r.stderr.count("--moe-experts 1 cannot be divided among 2 ranks") == 1, r.stderr
    assert rows == []


@pytest.mark.parametrize("E,k,capacity", [(4, 2, 0.0), (3, 1, 0.5)], ids=["E4-top2-dropless", "E3-top1-capacity"])
def test_bench_moe_all_gather_dispatcher_counts_its_formulas(tmp_path, E, k, capacity):
    """--moe-dispatcher allgather at 2 ranks: per step, two all-gathers and two reduce-scatters of every replica's
    admitted rows and one all-gather of the counts (T E int64), each equal to the formula worked out here from
    the routing the bench reports; its wire bytes (T - 1) / T of those; the same routing as the all-to-all's."""
    r, rows = bench(2, tmp_path, "--moe-experts", str(E), "--moe-top-k", str(k), "--moe-capacity", str(capacity),
                    "--moe-dispatcher", "allgather")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("all-gather + reduce-scatter rows on rank 0") == 1
    m = rows[0]["moe"]
    assert m["dispatcher"] == rows[0]["routing"]["moe_dispatcher"] == "allgather"
    admitted = sum(m["tokens_per_expert"])                      # every replica's admitted rows
    calls = {key: v["calls"] for key, v in m["collectives_per_step"].items()}
    assert calls == {"ep/all_gather_counts": 1, "ep/all_gather": 2, "ep/reduce_scatter": 2}
    per = m["collective_bytes_rank"]
    assert per["ep/all_gather"]["measured"] == per["ep/reduce_scatter"]["measured"] == 2 * admitted * C * 4
    assert per["ep/all_gather_counts"]["measured"] == per["ep/all_gather_counts"]["formula"] == 2 * E * 8
    assert all(v["measured"] == v["formula"] for v in per.values())
    assert m["all_gather_bytes_rank"]["measured"] == m["all_gather_bytes_rank"]["formula"] == 4 * admitted * C * 4
    assert m["wire_bytes_rank"]["measured"] == m["wire_bytes_rank"]["formula"] == (4 * admitted * C * 4 + 2 * E * 8) / 2
    if not capacity:
        assert m["all_gather_bytes_rank"]["uniform_formula"] == 4 * k * 2 * B * S * C * 4
    a2a = bench(2, tmp_path, "--moe-experts", str(E), "--moe-top-k", str(k), "--moe-capacity", str(capacity))[1]
    assert a2a[-1]["moe"]["tokens_per_expert"] == m["tokens_per_expert"]    # the same routing, the same drops
    assert m["bytes_per_token"] > a2a[-1]["moe"]["bytes_per_token"]


def test_bench_moe_passes_the_router_options(tmp_path):
    """--moe-router sigmoid --moe-gate-scale 2.5 reach the layer's config (recorded from it; the choice, so the
    bytes, are softmax's: top-k of sigmoid(z) is top-k of z); topk-softmax with --moe-topk-norm none is refused
    before anything runs, as in train."""
    r, rows = bench(2, tmp_path, "--moe-experts", "4", "--moe-router", "sigmoid", "--moe-gate-scale", "2.5")
    assert r.returncode == 0, r.stderr
    assert rows[0]["routing"]["moe_router"] == "sigmoid" and rows[0]["routing"]["moe_gate_scale"] == 2.5
    assert "router sigmoid, gate-scale 2.5" in r.stdout
    r, rows = bench(2, tmp_path, "--moe-router", "topk-softmax", "--moe-topk-norm", "none")
    assert r.returncode == 2 and r.stderr.count("normalises the k gates by definition") == 1, r.stderr
