"""A run's folder belongs to one run (mpi_tp.training.run_dir): a fresh run refuses a folder holding another
run (--resume or --overwrite), two jobs cannot share one (a lock with a heartbeat), a lock left by a
killed job is taken over, --resume refuses another model; export, plan --emit-config, calibrate --out
and --trace never replace a file unasked. Every refusal is one line, exit 2, and leaves the first run's
files byte for byte as they were.

    python -m pytest -q --with-mpi tests/test_run_dir.py          (real jobs, started with mpiexec)
"""
import datetime
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from jobs import MPIEXEC, STOP, clean_env, mpirun

from mpi_tp.core.errors import UserError
from mpi_tp.training import run_dir

cli = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "2",
         "--eval-batches", "1", "--sample-len", "0", "--log-every", "1"]


def snapshot(folder) -> dict:
    """Every file below folder (the lock aside): its SHA-256."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if name != run_dir.LOCK:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def one_line_error(r, *needles):
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpi-tp: error: ") and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def start(args, cwd=None):
    """A training job in the background, in its own session (so that the whole job can be killed)."""
    return subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi_tp", "train", *args], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=cwd)


def wait_for(path, job, seconds=120):
    t = time.time()
    while not os.path.exists(path):
        assert job.poll() is None, job.communicate()
        assert time.time() - t < seconds, f"{path} did not appear"
        time.sleep(0.2)


@cli
def test_a_fresh_run_refuses_a_folder_holding_a_run(tmp_path):
    out = tmp_path / "o"
    assert mpirun(2, "train", *SMALL, "--steps", "4", "--save-every", "2", "--out", str(out)).returncode == 0
    before = snapshot(out)
    r = mpirun(2, "train", *SMALL, "--steps", "4", "--save-every", "2", "--seed", "7", "--out", str(out))
    one_line_error(r, f"--out {out} holds a run already (checkpoints to step 4, last written", "--resume",
                   "--overwrite")
    assert snapshot(out) == before and not os.path.exists(out / run_dir.LOCK)
    r = mpirun(2, "train", *SMALL, "--steps", "4", "--seed", "7", "--out", str(out), "--overwrite")
    assert r.returncode == 0, r.stderr
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("o.replaced-")]
    assert len(aside) == 1 and f"--overwrite: moved the run that was in {out}" in r.stdout and str(aside[0]) in r.stdout
    assert snapshot(aside[0]) == before                              # moved, not changed
    assert json.load(open(out / "config.json"))["seed"] == 7 and not os.path.exists(out / run_dir.LOCK)
    one_line_error(mpirun(2, "train", *SMALL, "--out", str(out), "--resume", "--overwrite"), "not both")


@cli
def test_two_jobs_in_one_folder(tmp_path):
    """The second job stops at once, naming the first; the first trains on, alone in its folder."""
    out = tmp_path / "o"
    first = start([*SMALL, "--steps", "1000000", "--out", str(out)])
    try:
        wait_for(out / "metrics.jsonl", first)
        holder = json.load(open(out / run_dir.LOCK))
        r = mpirun(2, "train", *SMALL, "--steps", "1000000", "--seed", "7", "--out", str(out))
        one_line_error(r, f"--out {out} is in use by another job: pid {holder['pid']} on {socket.gethostname()}")
        r = mpirun(2, "train", *SMALL, "--steps", "1000000", "--out", str(out), "--resume")
        one_line_error(r, "in use by another job")
    finally:
        first.send_signal(STOP)                          # pre-emption: it saves and leaves
        first.communicate(timeout=120)
    assert json.load(open(out / "config.json"))["seed"] != 7 and not os.path.exists(out / run_dir.LOCK)


@cli
def test_jobs_started_together_get_folders_of_their_own(tmp_path):
    jobs = [start([*SMALL, "--steps", "2"], cwd=tmp_path) for _ in range(2)]
    for job in jobs:
        _, err = job.communicate(timeout=180)
        assert job.returncode == 0, err
    runs = sorted(os.listdir(tmp_path / "runs"))
    assert len(runs) == 2 and all(os.path.isfile(tmp_path / "runs" / r / "run.json") for r in runs), runs


def test_the_default_folder_never_collides(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 12, 1, 20, 41, 0)
    monkeypatch.setattr(run_dir.datetime, "datetime", Frozen)
    made = [run_dir.new_run_dir(str(tmp_path / "runs")) for _ in range(3)]
    assert [os.path.basename(m) for m in made] == ["20261201-204100", "20261201-204100-2", "20261201-204100-3"]


@cli
def test_a_killed_jobs_lock_is_taken_over_by_resume(tmp_path):
    out = tmp_path / "o"
    job = start([*SMALL, "--steps", "1000000", "--save-every", "2", "--out", str(out)])
    try:
        wait_for(out / "checkpoints" / "latest", job)
        holder = json.load(open(out / run_dir.LOCK))
    finally:
        # SIGKILL for rank 0, the lock's holder (the launcher puts each rank in a session of its own), then
        # for mpiexec: no chance to clean up, so the lock stays
        os.kill(holder["pid"], signal.SIGKILL)
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate(timeout=60)
    assert os.path.exists(out / run_dir.LOCK)
    r = mpirun(2, "train", *SMALL, "--steps", "6", "--save-every", "2", "--out", str(out), "--resume")
    assert r.returncode == 0, r.stderr
    assert f"took over the lock of {out} left by pid {holder['pid']}" in r.stdout and "that job is gone" in r.stdout
    assert "continuing from" in r.stdout and not os.path.exists(out / run_dir.LOCK)
    one_line_error(mpirun(2, "train", *SMALL, "--steps", "8", "--out", str(out)), "holds a run already")


def test_another_hosts_lock_is_stale_only_without_a_heartbeat(tmp_path, monkeypatch):
    """A holder on another host cannot be asked whether it lives: its heartbeat says, after
    MPI_TP_LOCK_STALE_S seconds."""
    monkeypatch.setenv("MPI_TP_LOCK_STALE_S", "60")
    lock = tmp_path / run_dir.LOCK
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": 1, "job": "4242", "started": "2026-12-01T08:00:00"}))
    with pytest.raises(UserError, match="in use by another job: pid 1 on node-elsewhere, Slurm job 4242"):
        run_dir.lock(str(tmp_path))
    old = time.time() - 120
    os.utime(lock, (old, old))
    held = run_dir.lock(str(tmp_path))
    assert "left by pid 1 on node-elsewhere" in held.took_over
    assert json.load(open(lock))["pid"] == os.getpid()
    held.release()
    assert not lock.exists()
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": 1, "job": "4242", "started": "2026-12-01T08:00:00"}))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")          # the same job, requeued on another node: its own lock
    held = run_dir.lock(str(tmp_path))
    assert "left by pid 1 on node-elsewhere, Slurm job 4242" in held.took_over
    held.release()
    monkeypatch.setenv("MPI_TP_LOCK_STALE_S", "soon")
    with pytest.raises(UserError, match="MPI_TP_LOCK_STALE_S"):
        run_dir.stale_after()


@cli
def test_resume_refuses_another_model_and_says_what_changed(tmp_path):
    out = tmp_path / "o"
    assert mpirun(2, "train", *SMALL, "--steps", "2", "--save-every", "2", "--out", str(out)).returncode == 0
    before = snapshot(out)
    r = mpirun(2, "train", *SMALL, "--steps", "4", "--n-embd", "32", "--out", str(out), "--resume")
    one_line_error(r, "was saved from a different model", "n_embd: checkpoint 16 vs model 32")
    assert snapshot(out) == before
    r = mpirun(2, "train", *SMALL, "--steps", "4", "--lr", "0.001", "--out", str(out), "--resume")
    assert r.returncode == 0 and "changed since: steps 2 -> 4, lr 0.003 -> 0.001" in r.stdout, r.stdout


@cli
def test_files_are_never_replaced_unasked(tmp_path):
    out = tmp_path / "o"
    trace = tmp_path / "t.json"
    trace.write_text("{}")
    one_line_error(mpirun(2, "train", *SMALL, "--steps", "2", "--out", str(out), "--trace", str(trace)),
                   f"--trace: {trace} exists already: pass --overwrite")
    assert trace.read_text() == "{}" and not os.path.exists(out / run_dir.LOCK)
    assert mpirun(2, "train", *SMALL, "--steps", "2", "--out", str(out)).returncode == 0
    target = tmp_path / "model.h5"
    target.write_text("mine")
    r = mpirun(1, "export", str(out / "checkpoints"), str(target))
    one_line_error(r, f"export: {target} exists already: pass --overwrite")
    assert target.read_text() == "mine"
    assert mpirun(1, "export", str(out / "checkpoints"), str(target), "--overwrite").returncode == 0
    assert target.read_bytes()[:4] == b"\x89HDF"
    config = tmp_path / "plan.json"
    config.write_text("mine")
    r = subprocess.run([sys.executable, "-m", "mpi_tp", "plan", "--machine", "dgx-a100", "--layers", "4", "--hidden",
                        "256", "--heads", "4", "--seq", "128", "--global-batch", "8", "--emit-config", str(config)],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    one_line_error(r, f"plan --emit-config: {config} exists already")
    assert config.read_text() == "mine"
