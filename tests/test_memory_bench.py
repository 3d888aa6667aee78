"""`mpi-tp bench --json` reports memory per rank measured (mpi_tp.core.memory): the categories at the step's
peak summing to its total, where it fell, and every rank's peak; with --pp, the stage holding the most.

These tests start their own MPI jobs, so they run in the one-rank pass only (no mpi marker).
"""
import json

from jobs import mpirun

from mpi_tp.core.memory import CATEGORIES


def bench_row(tmp_path, *options) -> dict:
    out = tmp_path / "bench.jsonl"
    r = mpirun(2, "bench", "--steps", "1", "--warmup", "0", "--json", str(out), *options)
    assert r.returncode == 0, r.stderr
    assert "memory at the step's peak" in r.stdout, r.stdout
    return json.loads(out.read_text().splitlines()[-1])


def test_bench_json_reports_the_peak_by_category(tmp_path):
    row = bench_row(tmp_path, "--custom", "32,2,2,16,2", "--tp", "1", "--dp", "2", "--zero", "1", "--recompute", "full")
    m = row["memory_measured"]
    assert (row["zero"], row["recompute"]) == (1, "full") and m["peak_at"] == "recompute"
    assert sum(m["peak"][k] for k in CATEGORIES) == m["peak"]["total"] == max(m["peak_total_per_rank"])
    assert abs(m["peak"]["optimizer"] - m["peak"]["parameters"]) <= 64     # ZeRO-1 at dp 2: 8 bytes x Psi / 2
    assert len(m["peak_total_per_rank"]) == 2 and m["device"] is None and m["samples"] > 0


def test_bench_pipeline_reports_the_fuller_stage(tmp_path):
    row = bench_row(tmp_path, "--custom", "32,2,2,16,2", "--pp", "2", "--micro-batches", "4")
    m = row["memory_measured"]
    assert m["rank"] == 0 and m["peak_at"] == "F"         # 1F1B: stage 0 holds two micro-batches' caches
    assert m["peak"]["communication"] > 0                  # the engine's receives posted ahead
    assert m["peak"]["activations"] == row["peak_activation_mb_per_stage"][0] * 2**20
