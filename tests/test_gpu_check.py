"""experiments/gpu/gpu_check.py, the one-command GPU check, run on the CuPy stand-in (--standin).

What runs here is the check's own machinery: its jobs, its comparisons (the GPU run against NumPy,
the pre-empted run against the uninterrupted one, generated and served text), its report, and its
failures (a check that cannot hold is a FAILED row and exit 1, never a traceback). On the stand-in
the numbers are NumPy's own, so the comparisons hold exactly; on a GPU they hold to 1e-8.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import MPIEXEC, clean_env

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")


def gpu_check(out, *args, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu" / "gpu_check.py"), "--standin", "--out",
                           str(out), *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env=clean_env())


def test_train_resume_decode_and_serve_pass_and_report(tmp_path):
    out = tmp_path / "report"
    r = gpu_check(out, "--only", r"^(train tp2-sp, aware 0|resume tp2-sp|decode, 1 rank|serve, 2 ranks, aware 0)$")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "report.json").read_text())
    rows = {row["check"]: row for row in report["checks"]}
    assert {name: row["result"] for name, row in rows.items()} == {     # the stand-in runs "aware 1" too: no n/a
        "train tp2-sp, aware 0": "ok", "resume tp2-sp": "ok", "decode, 1 rank": "ok", "serve, 2 ranks, aware 0": "ok"}
    assert rows["train tp2-sp, aware 0"]["detail"].startswith("losses 0.0e+00, checkpoint 0.0e+00")
    assert "bit for bit" in rows["resume tp2-sp"]["detail"]
    assert report["machine"]["standin"] is True and report["machine"]["cupy"] == "0+standin"
    md = (out / "report.md").read_text()
    assert "| resume tp2-sp | ok |" in md and "on the CuPy stand-in" in md
    assert (out / "logs" / "resume tp2-sp.log").read_text().count("$ MPI_TP_CUDA_AWARE=0") == 2
    assert not (out / "runs").exists()                             # the runs go, the report and logs stay


def test_a_check_that_cannot_hold_fails_with_its_reason(tmp_path):
    r = gpu_check(tmp_path / "report", "--only", r"^resume tp2-sp$")   # without the uninterrupted run it compares to
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED  resume tp2-sp" in r.stdout and "uninterrupted GPU run is missing" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_out_of_time_checks_are_not_run_and_fail(tmp_path):
    r = gpu_check(tmp_path / "report", "--only", "^decode", "--budget", "0")
    assert r.returncode == 1 and "NOT RUN  decode, 1 rank" in r.stdout, r.stdout + r.stderr


def test_bad_input_gets_one_line(tmp_path):
    (tmp_path / "taken").mkdir()
    r = gpu_check(tmp_path / "taken")
    assert r.returncode == 2 and "exists; give a new --out" in r.stdout and "Traceback" not in r.stderr
    r = gpu_check(tmp_path / "new", "--only", "(")
    assert r.returncode == 2 and "is not a regular expression" in r.stderr and "Traceback" not in r.stderr
