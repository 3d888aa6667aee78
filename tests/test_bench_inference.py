"""`mpi-tp bench --inference` end to end on a tiny shape: its JSON fields, and the collectives it
counted per decode step equal to the closed form (never a time).

These tests start their own MPI jobs, so they run in the one-rank pass only (no mpi marker).
"""
import json
import os
import shutil
import sys

import pytest
from jobs import run_job

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
C, H, L, S, V = 64, 4, 2, 32, 256
TINY = ["bench", "--inference", "--custom", f"{C},{H},{L},{S},1", "--prompt-len", "8", "--new-tokens", "4",
        "--batch", "1", "3", "--repeats", "1"]
FIELDS = ("ttft_ms", "decode_ms_per_step", "tokens_per_s", "comm_share", "comm_floor_ms_per_step",
          "collectives_per_step", "read_bytes_per_step_rank0", "bandwidth_gbs_per_rank", "limit_ms",
          "limit_ratio", "environment")


def bench(n, tmp_path, *extra):
    out = tmp_path / f"inference_{n}.jsonl"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi_tp", *TINY, "--json", str(out), *extra]
    r = run_job(cmd, timeout=240)
    return r, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def closed_form(tp, B, itemsize=4):
    """Per decode step: 2 all-reduces of (B, 1, C) per block plus the embedding's; one all-gather of B x V."""
    if tp == 1:
        return {}
    return {"tp/all_reduce": {"calls": 2 * L + 1, "bytes": (2 * L + 1) * B * C * itemsize},
            "tp/all_gather": {"calls": 1, "bytes": B * V * itemsize}}


@pytest.mark.parametrize("ranks", [1, 2])
def test_bench_inference_fields_and_collectives(tmp_path, ranks):
    r, rows = bench(ranks, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("cached decoding, C=64") == 1 and "x limit" in r.stdout    # rank 0 prints the table
    assert [row["batch"] for row in rows] == [1, 3]
    for row in rows:
        assert all(k in row for k in FIELDS), sorted(set(FIELDS) - set(row))
        assert row["mode"] == "inference" and row["tp"] == ranks
        assert row["shape"] == {"n_embd": C, "n_head": H, "n_layer": L, "block_size": S}
        assert set(row["decode_ms_per_step"]) >= {"median", "p90"}
        assert len(row["bandwidth_gbs_per_rank"]) == ranks
        counted = row["collectives_per_step"]
        assert counted["measured"] == counted["formula"] == closed_form(ranks, row["batch"])
        read = row["read_bytes_per_step_rank0"]
        assert read["kv_cache"] == 2 * L * row["batch"] * (H // ranks) * (8 + (4 + 1) / 2) * (C // H) * 4


def test_bench_inference_refuses_decoding_past_block_size(tmp_path):
    r, rows = bench(1, tmp_path, "--new-tokens", str(S))
    assert r.returncode == 2 and r.stderr.count("must stay within block_size 32") == 1, r.stderr
    assert rows == []
