"""The slurm/ scripts on a real (local) Slurm cluster: one node, two emulated nodes, a job array.

Needs the slurm-local harness (../shared/slurm-local beside the repository, or
MPI_TP_SLURM_LOCAL=path) and root (it installs and starts slurmctld/slurmd);
skips with the reason otherwise. One-rank pass only.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.environ.get("MPI_TP_SLURM_LOCAL", os.path.join(os.path.dirname(REPO), "shared", "slurm-local"))
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "2",
        "--eval-batches", "1", "--log-every", "3", "--eval-every", "6", "--sample-len", "0", "--steps", "6"]


def _why_not():
    if not os.path.isfile(os.path.join(HARNESS, "start.sh")):
        return f"no slurm-local harness at {HARNESS} (set MPI_TP_SLURM_LOCAL)"
    if os.geteuid() != 0:
        return "the local Slurm harness needs root"
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        return "no apt-get to install Slurm with"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def harness(script, nodes, timeout=300):
    env = dict(os.environ, SLURM_LOCAL_NODES=str(nodes))
    r = subprocess.run(["bash", os.path.join(HARNESS, script)], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{script} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def env_for_jobs(tmp_path):
    """sbatch hands the caller's environment to the job: the venv's PATH, a clean MPI state."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPI_TP_"))}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["MPI_TP_OUT"] = str(tmp_path / "out")
    env["MPI_TP_RESULTS"] = str(tmp_path / "results")
    return env


def submit(tmp_path, script, *args, env_extra=None):
    (tmp_path / "logs").mkdir(exist_ok=True)
    env = env_for_jobs(tmp_path)
    env.update(env_extra or {})
    cmd = ["bash", os.path.join(HARNESS, "sbatch-wait.sh"), "--timeout", "240", script, *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def one_node():
    harness("start.sh", 1)
    yield
    harness("stop.sh", 1)


def test_single_node(one_node, tmp_path):
    r = submit(tmp_path, os.path.join(REPO, "slurm", "train_single_node.sbatch"), *TINY)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 tasks" in r.stdout and "tp=2 x dp=1" in r.stdout and "step 6/6" in r.stdout
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["layout"]["world"] == 2 and run["final_val_loss"] < 6


def test_separate_programs_are_refused(one_node, tmp_path):
    r = submit(tmp_path, os.path.join(REPO, "slurm", "train_single_node.sbatch"), *TINY,
               env_extra={"MPI_TP_SRUN_MPI": "none"})
    assert r.returncode != 0
    assert "separate programs" in r.stdout + r.stderr


def test_scaling_array(one_node, tmp_path):
    r = submit(tmp_path, "--array=0-0", os.path.join(REPO, "slurm", "scaling_array.sbatch"), "--warmup", "1",
               env_extra={"MPI_TP_SHAPES": "32,2,1,16,2", "MPI_TP_BENCH_STEPS": "2"})
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(l) for f in (tmp_path / "results").iterdir() for l in f.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["tp"] == 2 and rows[0]["shape"]["n_embd"] == 32


def test_two_nodes(tmp_path):
    """TP inside each emulated node, DP across the two, with the hierarchical gradient all-reduce."""
    harness("start.sh", 2)
    try:
        r = submit(tmp_path, os.path.join(REPO, "slurm", "train_multi_node.sbatch"), *TINY,
                   "--dp-allreduce", "hierarchical")
    finally:
        harness("stop.sh", 2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 tasks on node[1-2]" in r.stdout and "tp=2 x dp=2" in r.stdout and "step 6/6" in r.stdout
