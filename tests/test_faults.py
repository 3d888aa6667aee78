"""Failure behaviour of `mpi-tp train` under mpiexec: pre-emption by SIGTERM, non-finite numbers,
a rank killed with SIGKILL. One-rank pass only: each test starts its own MPI job."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from jobs import MPIEXEC, STOP, clean_env, mpirun, run_job
from test_checkpoint_cli import TINY, losses

from mpi_tp import checkpoint as ck

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")


def start(n, *args, env_extra=None):
    env = clean_env()
    env.update(env_extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi_tp", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rank_pids(marker):
    """The python processes of a job, found by a string unique to its command line. The ranks' first
    word is this python; the launcher's is mpiexec (MPICH) or prterun (Open MPI execs it), and the
    launcher must not get the signal meant for the ranks."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if any(marker.encode() in c for c in cmd) and b"mpi_tp" in cmd and cmd[0] == os.fsencode(sys.executable):
                pids.append(int(pid))
    return pids


def wait_for(proc, text, timeout=120):
    """Read the job's stdout until a line contains `text`; returns everything read."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"never saw {text!r}; output so far:\n{''.join(seen)}")


def test_sigterm_saves_and_resume_is_exact(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert mpirun(2, "train", *TINY, "--steps", "10", "--out", a).returncode == 0
    env = clean_env()
    env["MPI_TP_FAILPOINT"] = "sigterm:4"              # every rank signals itself after step 4
    r = run_job([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi_tp", "train", *TINY, "--steps", "10", "--out", b],
                timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "SIGTERM received: saved step 4" in r.stdout
    assert ck.complete_steps(os.path.join(b, "checkpoints")) == [4]
    r = mpirun(2, "train", *TINY, "--steps", "10", "--out", b, "--resume")
    assert r.returncode == 0, r.stderr
    assert losses(a) == losses(b)                                     # bitwise, as if never stopped


@pytest.mark.launcher
@pytest.mark.parametrize("to", ["ranks", "mpiexec"])
def test_a_real_stop_signal(tmp_path, to):
    """A stop signal from outside in the middle of training: SIGTERM to every rank, as Slurm sends it to
    every task; or to mpiexec the signal it forwards to every rank while the job runs on (STOP: SIGTERM
    under MPICH, SIGUSR1 under Open MPI, whose launcher ends the ranks itself on a SIGTERM)."""
    out = str(tmp_path / "run")
    proc = start(2, "train", *TINY, "--steps", "100000", "--log-every", "1", "--out", out)
    sent = signal.SIGTERM if to == "ranks" else STOP
    try:
        wait_for(proc, " 3/100000")
        for pid in rank_pids(out) if to == "ranks" else [proc.pid]:
            os.kill(pid, sent)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert f"{sent.name} received: saved step" in stdout
    step = ck.complete_steps(os.path.join(out, "checkpoints"))[-1]
    r = mpirun(2, "train", *TINY, "--steps", str(step + 2), "--out", out, "--resume")
    assert r.returncode == 0 and f"(step {step})" in r.stdout, r.stderr


def test_nan_gradient_stops_or_skips(tmp_path):
    out = str(tmp_path / "stop")
    env = clean_env()
    env["MPI_TP_FAILPOINT"] = "nan-grad:5"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi_tp", "train", *TINY, "--steps", "8",
           "--save-every", "2"]
    r = run_job(cmd + ["--out", out], timeout=120, env=env)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert r.stderr.count("the gradient norm became nan at step 5") == 1 and "Traceback" not in r.stderr
    assert ck.complete_steps(os.path.join(out, "checkpoints")) == [2, 4]     # nothing saved after the fault
    skip = str(tmp_path / "skip")
    r = run_job(cmd + ["--out", skip, "--on-nonfinite", "skip"], timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "step 5: the gradient norm became nan; step skipped" in r.stdout
    entries = [json.loads(l) for l in open(os.path.join(skip, "metrics.jsonl"))]
    assert any(e.get("skipped") for e in entries) and 5 not in [e["step"] for e in entries if "loss" in e]


@pytest.mark.launcher
def test_sigkill_of_a_rank_ends_the_job_and_keeps_the_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    proc = start(2, "train", *TINY, "--steps", "100000", "--save-every", "2", "--out", out)
    try:
        wait_for(proc, "saved ")
        os.kill(rank_pids(out)[-1], signal.SIGKILL)
        proc.communicate(timeout=60)                                  # the job ends: nothing hangs
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    with ck.Checkpoint(os.path.join(out, "checkpoints")) as c:
        assert c.step >= 2 and c.verify() == []


def failing(n, *args, failpoint, timeout=120):
    env = clean_env()
    env["MPI_TP_FAILPOINT"] = failpoint
    return run_job([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi_tp", *args], timeout, env)


def logged_steps(out):
    return [json.loads(l)["step"] for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]


def test_resume_after_a_crash_logs_every_step_once(tmp_path):
    """Steps 4-6 ran and were logged, then the save at 6 died: the resumed run logs them again, once."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert mpirun(2, "train", *TINY, "--steps", "8", "--out", a).returncode == 0
    r = failing(2, "train", *TINY, "--steps", "8", "--save-every", "3", "--out", b,
                failpoint="save-before-index:6")
    assert r.returncode != 0 and logged_steps(b) == [1, 2, 3, 4, 5, 6]
    assert mpirun(2, "train", *TINY, "--steps", "8", "--out", b, "--resume").returncode == 0
    assert logged_steps(b) == list(range(1, 9))
    assert losses(a) == losses(b)                                     # and bitwise as if never stopped


def test_skipped_last_step_still_saves(tmp_path):
    out = str(tmp_path / "run")
    r = failing(2, "train", *TINY, "--steps", "6", "--on-nonfinite", "skip", "--out", out, failpoint="nan-grad:6")
    assert r.returncode == 0, r.stderr
    assert "step 6: the gradient norm became nan; step skipped" in r.stdout
    assert ck.complete_steps(os.path.join(out, "checkpoints")) == [6]


def test_sigterm_during_a_skipped_step_stops_at_that_step(tmp_path):
    out = str(tmp_path / "run")
    r = failing(2, "train", *TINY, "--steps", "10", "--on-nonfinite", "skip", "--out", out,
                failpoint="nan-grad:5,sigterm:5")
    assert r.returncode == 0, r.stderr
    assert "step 5: the gradient norm became nan; step skipped" in r.stdout
    assert "SIGTERM received: saved step 5" in r.stdout
    assert ck.complete_steps(os.path.join(out, "checkpoints")) == [5]


def test_sigterm_at_the_last_step_completes_the_run(tmp_path):
    out = str(tmp_path / "run")
    r = failing(2, "train", *TINY, "--steps", "6", "--out", out, failpoint="sigterm:6")
    assert r.returncode == 0, r.stderr
    assert "SIGTERM received" not in r.stdout and "done in" in r.stdout
    summary = json.load(open(os.path.join(out, "run.json")))
    assert "preempted_at" not in summary and summary["final_val_loss"] == summary["final_val_loss"]   # not NaN
    r = mpirun(2, "train", *TINY, "--steps", "6", "--out", out, "--resume")
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stderr
    assert json.load(open(os.path.join(out, "run.json"))) == summary  # the summary stays as it was


@pytest.mark.launcher
def test_pipeline_sigterm_and_resume(tmp_path):
    """--pp 2: SIGTERM after step 2 saves at a step every stage agrees on; --resume continues bitwise."""
    args = ["--n-layer", "3", "--n-head", "3", "--n-embd", "24", "--block-size", "16", "--batch-size", "2",
            "--micro-batches", "2", "--pp", "2", "--dropout", "0.1", "--log-every", "1", "--eval-every", "1000",
            "--eval-batches", "1", "--sample-len", "0", "--steps", "4"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert mpirun(2, "train", *args, "--out", a).returncode == 0
    r = failing(2, "train", *args, "--out", b, failpoint="sigterm:2")
    assert r.returncode == 0 and "SIGTERM received: saved step 2" in r.stdout, r.stderr
    assert ck.complete_steps(os.path.join(b, "checkpoints")) == [2]
    assert mpirun(2, "train", *args, "--out", b, "--resume").returncode == 0
    assert losses(a) == losses(b)


@pytest.mark.launcher
def test_exception_in_one_stage_aborts_the_job(tmp_path):
    """Stage 1 raises in a backward pass while stage 0 waits to receive its gradient: the job ends."""
    script = tmp_path / "stage_crash.py"
    script.write_text(
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from mpi_tp.core.runtime import install_abort_hook\n"
        "from mpi_tp.model.config import GPTConfig\n"
        "from mpi_tp.model.chunks import build_stage\n"
        "from mpi_tp.parallel.topology import Topology\n"
        "from mpi_tp.training.step import forward_backward\n"
        "install_abort_hook()\n"
        "topo = Topology.create(MPI.COMM_WORLD, tp=1, pp=2, dp=1)\n"
        "stage = build_stage(GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=8), topo,\n"
        "                      'float64', 0, False, '1f1b', 2)\n"
        "if topo.pp.rank == 1:\n"
        "    def broken(*a, **k):\n"
        "        raise RuntimeError('boom in stage 1')\n"
        "    stage.chunks[0].backward = broken\n"
        "x = np.zeros((2, 4), dtype=int)\n"
        "forward_backward(stage, x, x, slice(0, 2))\n")
    r = run_job([MPIEXEC, "-n", "2", sys.executable, str(script)], timeout=60)
    assert r.returncode != 0
    assert r.stderr.count("RuntimeError: boom in stage 1") == 1 and "[rank 1]" in r.stderr
