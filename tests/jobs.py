"""What the tests that start their own MPI jobs share: the launcher, a clean environment for the child job,
its stderr without the launcher's own report, and a few layouts trained and read back.

    r = mpirun(2, "train", "--steps", "3")          # a subprocess.run result; r.stderr is what mpi_tp printed
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

from mpi_tp.core.mpi_library import child_job_env, is_open_mpi

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
TIMEOUT = 240
# A tiny model: the options most job tests train with.
TINY = ["--n-layer", "2", "--n-head", "3", "--n-embd", "24", "--block-size", "16", "--batch-size", "8",
        "--eval-batches", "4", "--log-every", "10", "--eval-every", "20", "--sample-len", "20"]
# Long enough to learn something: ~10 s on 2 cores. Validation loss, on the default data, after 200 steps:
# 2.66 nats/byte; unigram entropy 3.14; an untrained model (--steps 1) 5.46, near ln 256 = 5.55.
LEARN = ["--steps", "200", "--warmup", "10", "--lr", "1e-2"]


def clean_env():
    """The parent may itself be an MPI process: a fresh environment for the child job (mpi_library.child_job_env)."""
    env = child_job_env()
    env["OMP_NUM_THREADS"] = "1"
    return env


# The launcher on PATH is the one of the library mpi4py loads (tests/run.sh runs the suite with each).
OPEN_MPI = is_open_mpi()
# What mpiexec forwards to every rank and then waits for them: SIGTERM under MPICH; Open MPI's ends the
# ranks itself a quarter second after a SIGTERM of its own, and forwards SIGUSR1 (runtime.STOP_SIGNALS).
STOP = signal.SIGUSR1 if OPEN_MPI else signal.SIGTERM
# Open MPI's launcher adds its own report, between lines of dashes, when a rank exits non-zero
# ("prterun detected that one or more processes exited with non-zero status ..."), and now and then a
# line of its PMIx server's as the job comes down ("[host:pid] PMIX ERROR: PMIX_ERR_UNREACH in file
# ..."); MPICH's adds none.
LAUNCHER_REPORT = re.compile(r"^-{20,}\n(?:(?!-{20,}).*\n)*?.*prterun detected.*\n(?:(?!-{20,}).*\n)*-{20,}\n?"
                             r"|^\[[^\]\n]+\] PMIX ERROR: PMIX_ERR_UNREACH .*\n?", re.MULTILINE)


def ours(stderr: str) -> str:
    """A job's stderr without its launcher's own report of a non-zero exit: what mpi_tp printed."""
    return LAUNCHER_REPORT.sub("", stderr)


def outer_world() -> int:
    """How many ranks the launcher that started this pytest gave it (1 when none did): MPICH's hydra sets
    PMI_SIZE, Open MPI OMPI_COMM_WORLD_SIZE."""
    return int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)


def run_job(cmd, timeout=TIMEOUT, env=None, **kw):
    """subprocess.run of an MPI job (a fresh environment, clean_env's unless given), its output captured as
    text; stderr holds what the ranks printed, the launcher's report of a non-zero exit left out (ours).
    Refused inside a multi-rank pytest: every rank would start the job (Open MPI's PMIx refuses a nested
    launch outright), so a test that launches carries the launcher mark, not the mpi one."""
    if outer_world() > 1:
        raise RuntimeError(f"this test starts its own MPI job but runs on {outer_world()} ranks: mark it "
                           "@pytest.mark.launcher and keep it out of the mpi passes (no mpi marker)")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env() if env is None else env,
                       check=False, **kw)
    r.stderr = ours(r.stderr)
    return r


def mpirun(n, *args, timeout=TIMEOUT):
    return run_job([MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi_tp", *args], timeout=timeout)


def train_layouts(tmp_path, common, layouts: dict, step: int) -> tuple[dict, dict]:
    """`mpi-tp train *common *layout --out tmp_path/NAME` at 2 ranks for each NAME: layout, each of which must
    succeed: ({NAME: its run.json}, {NAME: {name: array}: its step's checkpoint's model/ and optim/ tensors})."""
    import h5py
    runs, tensors = {}, {}
    for name, layout in layouts.items():
        r = mpirun(2, "train", *common, *layout, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads((tmp_path / name / "run.json").read_text())
        with h5py.File(tmp_path / name / "checkpoints" / f"step-{step:08d}" / "index.h5", "r") as f:
            names = []
            f.visit(lambda n: names.append(n) if n.startswith(("model/", "optim/")) and
                    isinstance(f[n], h5py.Dataset) else None)
            tensors[name] = {n: f[n][...] for n in names}
    return runs, tensors
