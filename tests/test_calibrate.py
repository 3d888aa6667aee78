"""`mpi-tp calibrate`: what it measures has the shape the cost model reads, and the file plans.

Values depend on the machine and its load, so the tests check ranges and structure; the
measured machines in experiments/planner/results/machine_*.json are the values in use.
"""
import json
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpi_tp.planning.calibrate import (ALLREDUCE_BYTES, CURVE_ROWS, fit_ring, gemm_curve, layer_overhead,
                                       overlap_fraction, summary, time_allreduces)
from mpi_tp.planning.machines import Machine


@pytest.mark.mpi(min_size=1)
def test_gemm_curve_and_overlap_on_every_rank(world):
    curve = gemm_curve(world, repeats=2)
    assert [r for r, _ in curve] == list(CURVE_ROWS) and all(f > 1e6 for _, f in curve)
    assert world.allreduce(curve[0][1], op=MPI.MAX) == curve[0][1]             # the slowest rank's, on every rank
    overlap = overlap_fraction(world, n_bytes=2**20, repeats=2)
    assert 0.0 <= overlap <= 1.0 and world.allreduce(overlap, op=MPI.MAX) == overlap
    if world.Get_size() == 1:
        assert overlap == 0.0                                                # nothing to overlap with
    points = time_allreduces(world, sizes=(1024, 2**20), repeats=2)
    assert [n for n, _ in points] == [1024, 2**20] and all(t > 0 for _, t in points)


def test_fit_ring_reads_alpha_from_the_intercept_and_beta_from_the_slope():
    """Points on t = 2 (T-1) alpha + 2 (T-1)/T n beta give back alpha and 1 / beta; summary prints each."""
    T, alpha, bw = 4, 5e-6, 2e9
    points = [[n, 2 * (T - 1) * alpha + 2 * (T - 1) / T * n / bw] for n in ALLREDUCE_BYTES]
    a, b = fit_ring(points, T)
    assert a == pytest.approx(alpha) and b == pytest.approx(bw)
    m = Machine("fit", 1, gemm_flops=1e10, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e9, intra_alpha=a, intra_bw=b,
                inter_alpha=a, inter_bw=b, gemm_curve=[[32, 1e9]], allreduce_points=points)
    lines = summary(m, T).splitlines()
    assert len(lines) == 1 + len(points)
    assert "alpha 5.0 us, bw 2.00 GB/s (beta = 1 / bw = 0.500 ns per byte)" in lines[0]
    assert all(f"{t * 1e6:8.1f} us measured, {t * 1e6:8.1f} us" in line for (_, t), line in zip(points, lines[1:]))


def test_layer_overhead_is_a_time_per_layer():
    seconds = layer_overhead(steps=3)
    assert 0.0 <= seconds < 0.1


def test_calibrate_writes_a_machine_the_planner_reads(tmp_path):
    out = tmp_path / "new" / "m.json"                # a folder that does not exist yet: created (lesson 9's case)
    r = subprocess.run([sys.executable, "-m", "mpi_tp", "calibrate", "--out", str(out), "--name", "ci"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = Machine.load(str(out))
    assert m.name == "ci" and m.ranks_per_node >= 1 and m.gemm_flops > 1e6 and m.elem_rate > 0
    assert [rows for rows, _ in m.gemm_curve] == list(CURVE_ROWS) and m.layer_overhead >= 0 and m.dp_overlap == 0.0
    assert m.allreduce_points == []                                          # one rank: no all-reduce to time
    plan = subprocess.run([sys.executable, "-m", "mpi_tp", "plan", "--machine", str(out), "--layers", "4",
                           "--hidden", "64", "--heads", "4", "--seq", "32", "--global-batch", "8", "--vocab", "256",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["ranked"]
    data = json.loads(out.read_text())
    data["gemm_curve"] = [[128, -1.0]]
    out.write_text(json.dumps(data))
    bad = subprocess.run(plan.args, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "gemm_curve" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("where,says", [("file/m.json", "cannot create the folder"), ("file", "exists already"),
                                        ("", "is a folder")])
def test_a_bad_out_is_one_line_before_measuring(tmp_path, where, says):
    """--out is checked before the measuring (it used to end, after it, in a traceback and MPI_Abort)."""
    (tmp_path / "file").write_text("x")
    r = subprocess.run([sys.executable, "-m", "mpi_tp", "calibrate", "--out", str(tmp_path / where)]
                       + (["--overwrite"] if where == "" else []), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_fit_ring_keeps_the_small_messages():
    """Timings that do not lie on one line (a cache effect at 4 MB, as measured): the fit weighs each point by
    its relative error, so the 1 KB all-reduce's microseconds are not lost to the large messages'
    milliseconds (plain least squares gave alpha 25 us for a 1 KB time of 7.3 us, issue 25)."""
    T = 2
    points = [[1024, 7.3e-6], [16384, 1.1e-5], [262144, 6.0e-5], [4194304, 2.9e-3], [16777216, 6.0e-3]]
    a, b = fit_ring(points, T)
    small = 2 * (T - 1) * a + 2 * (T - 1) / T * 1024 / b
    assert abs(small / 7.3e-6 - 1) < 0.5 and a < 7.3e-6 / 2
    for n, t in points:
        model = 2 * (T - 1) * a + 2 * (T - 1) / T * n / b
        assert 0.2 < model / t < 5, (n, t, model)


def test_planning_several_nodes_with_a_one_node_calibration_says_so(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "one-node.json"
    Machine("one-node", 2, gemm_flops=1e10, elem_rate=1e9, mem_bw=1e10, mem_bytes=1e9, intra_alpha=4e-6,
            intra_bw=3e9, inter_alpha=4e-6, inter_bw=3e9).save(str(path))
    r = subprocess.run([sys.executable, "-m", "mpi_tp", "plan", "--machine", str(path), "--nodes", "2", "--layers",
                        "4", "--hidden", "64", "--heads", "4", "--seq", "64", "--global-batch", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "calibrated on one node" in r.stderr and "calibrate across two nodes" in r.stderr, \
        r.stderr
