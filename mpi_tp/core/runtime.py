"""Running under MPI without hangs: one message per error, and a whole-job abort on a crash.

Two kinds of failure, two treatments:

- Expected errors (a bad option, a missing file, a layout that does not fit, a
  damaged checkpoint, a full disk) are raised on purpose as `UserError` (or one
  of its kinds: ConfigError, TopologyError, DataError, CheckpointError,
  BackendError). `collective_setup` runs a set-up step on every rank, then the
  ranks agree: if any rank failed, rank 0 prints that rank's message once and
  every rank exits with status 2. Nobody is left waiting in a collective.
- Anything else (a bug, out of memory) can strike one rank mid-step while the
  others wait in a collective. `install_abort_hook` makes an uncaught exception
  print its traceback, tagged with the rank, and call MPI_Abort, which ends
  every rank of the job at once. An OSError or ValueError that nobody raised
  on purpose is such a bug: it shows its traceback.
"""
from __future__ import annotations

import os
import platform
import signal
import sys
import time
import traceback

from mpi4py import MPI

from mpi_tp.core.errors import UserError
from mpi_tp.core.mpi_library import library_version, srun_mpi

ABORT_GRACE = 0.5       # seconds between a crashed rank's message and MPI_Abort (install_abort_hook)

# The signals that ask a job to stop cleanly (training saves a checkpoint and exits 0; a server finishes the
# batch in flight). SIGTERM is what Slurm sends every task (scancel, the time limit with --signal=TERM@60)
# and what MPICH's mpiexec forwards to the ranks. Open MPI's mpiexec answers a SIGTERM of its own by
# ending the ranks itself (SIGCONT, SIGTERM, SIGKILL within about 0.25 s: no time to save), but it
# forwards SIGUSR1 and lets the job run on, as MPICH's does: `kill -USR1 <mpiexec's pid>` stops a job
# cleanly under either MPI (docs/clusters.md#open-mpi).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def rank0_print(*args, comm=MPI.COMM_WORLD, **kw) -> None:
    if comm.Get_rank() == 0:
        print(*args, **kw, flush=True)


def install_abort_hook(comm=MPI.COMM_WORLD) -> None:
    """An uncaught exception on any rank prints once (with its rank) and aborts the whole job."""
    if comm.Get_size() == 1:
        return

    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.write(f"[rank {comm.Get_rank()}] {text}")
        sys.stderr.write(f"[rank {comm.Get_rank()}] aborting all {comm.Get_size()} ranks\n")
        sys.stderr.flush()
        # the launcher reads this rank's stderr through a pipe and stops reading when the abort kills the
        # job: on a loaded machine MPICH's hydra lost the whole message 1 time in 20; a moment first
        time.sleep(ABORT_GRACE)
        comm.Abort(1)

    sys.excepthook = hook


def collective_setup(fn, *args, comm=MPI.COMM_WORLD, **kw):
    """Run fn on every rank; if it raises a UserError on any rank, raise UserError on all.

    The message and status are those of the lowest failing rank, the message
    prefixed by its rank when it is not rank 0. Other exceptions propagate (and
    abort, see above).
    """
    try:
        result, failure = fn(*args, **kw), None
    except UserError as e:
        result, failure = None, (str(e) or type(e).__name__, e.status)
    failures = comm.allgather(failure)          # set-up only: a few bytes, pickled once
    for rank, f in enumerate(failures):
        if f is not None:
            message, status = f
            raise UserError(message if rank == 0 else f"(rank {rank}) {message}", status)
    return result


def check_world_size(comm=MPI.COMM_WORLD, expect: int | None = None) -> None:
    """Refuse to run as N separate one-rank programs when the launcher meant one N-rank job.

    The launchers export the size of the job they started (MPICH/Hydra and Slurm's
    PMI: PMI_SIZE; Open MPI: OMPI_COMM_WORLD_SIZE; srun: SLURM_STEP_NUM_TASKS);
    `expect` (or MPI_TP_EXPECT_WORLD) adds an explicit check.
    """
    size = comm.Get_size()
    claims = {k: os.environ.get(k) for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")}
    if os.environ.get("SLURM_PROCID") is not None and os.environ.get("SLURM_STEP_NUM_TASKS"):
        claims["SLURM_STEP_NUM_TASKS"] = os.environ["SLURM_STEP_NUM_TASKS"]
    if expect is None and os.environ.get("MPI_TP_EXPECT_WORLD"):
        expect = int(os.environ["MPI_TP_EXPECT_WORLD"])
    if expect is not None:
        claims["expected"] = str(expect)
    for source, value in claims.items():
        if value and value.isdigit() and int(value) != size:
            raise UserError(
                f"MPI sees a world of {size} rank(s) but {source} says {value}: the launcher started "
                f"separate programs instead of one job. Use the mpiexec of the MPI library mpi4py runs on "
                f"({library_version()}), or srun --mpi={srun_mpi()} (not --mpi=none).")


BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def limit_blas_threads(comm=MPI.COMM_WORLD) -> int | None:
    """Share this node's cores among its ranks: threads per rank = cores / ranks on the node.

    Without this, every rank's BLAS starts one thread per core and the ranks fight over
    the cores (a 2-rank job on 2 cores ran 5x slower). Must run before NumPy is
    imported; a value the user set in the environment is left alone. Returns the
    number chosen, or None when the user's setting stands.
    """
    if any(os.environ.get(v) for v in BLAS_THREAD_VARS):
        return None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    ranks_here = local.Get_size()
    local.Free()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // ranks_here)
    for v in BLAS_THREAD_VARS:
        os.environ[v] = str(threads)
    return threads


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), for the stamp of a figure or a benchmark; else the arch."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_text() -> str:
    """'AMD EPYC, 2 cores, MPICH 5.0.2': the machine and MPI library a figure's stamp names."""
    mpi = library_version()
    return f"{cpu_name()}, {os.cpu_count()} cores, {mpi}"


def keep_freed_memory() -> dict:
    """For a command that runs training steps (train, bench): glibc keeps freed memory for the process.

    Each step allocates and frees the same activation-sized arrays (NumPy's fresh outputs, MBs each).
    With glibc's defaults the freed top of the heap goes back to the kernel once it is larger than the
    trim threshold, so the next step faults every 4 KiB page in again: 24,111 minor faults (94 MiB) per
    step at bench shape a, a quarter of the step on the Intel KVM build machine (docs/performance.md).
    Raising the mmap and trim thresholds keeps the pages mapped: the peak is the same, it is not given
    back between steps. Called by the commands, never on import (a library leaves the process's
    allocator alone: tests/test_runtime.py). The user's choice stands: with MALLOC_* or a
    glibc.malloc tunable in the environment nothing is changed, and MPI_TP_MALLOC=system asks for
    glibc's defaults. Returns what is in force, as bench records it ({} for glibc's defaults)."""
    global MALLOC
    MALLOC = {k: v for k, v in os.environ.items()
              if k.startswith("MALLOC_") or (k == "GLIBC_TUNABLES" and "malloc" in v)}
    if MALLOC or os.environ.get("MPI_TP_MALLOC") == "system":
        return MALLOC
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        ok = libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)          # the largest glibc accepts
        ok &= libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):                            # not glibc: its own defaults stand
        return MALLOC
    if ok:
        MALLOC = {"mpi-tp": "freed memory kept (mallopt: mmap threshold 32 MiB, trim threshold 2 GiB)"}
    return MALLOC


MALLOC: dict = {}        # what keep_freed_memory put in force in this process ({}: glibc's defaults)
