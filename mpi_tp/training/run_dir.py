"""A run's folder belongs to one run, and to one job at a time.

    lock = claim(out, resume=..., overwrite=...)    # rank 0, before anything is written in out
    ...
    lock.release()                                  # at the end (also on errors; atexit as a last resort)

A folder holds a run when it has checkpoints (a complete step), metrics.jsonl, config.json or
run.json. A fresh run (no --resume) refuses such a folder with one line that says what is there
(the last step, when it was written) and the two ways on: --resume, or --overwrite, which moves
the old run aside to OUT.replaced-<date-time> (nothing is deleted) and says so. The default folder,
runs/<date-time>, is created with an exclusive mkdir: a second job starting in the same second gets
runs/<date-time>-2, and so on.

The lock is OUT/.lock, created with O_CREAT | O_EXCL (atomic on a local filesystem, on NFS v3 and
later, on Lustre and GPFS: what this relies on), holding the holder's host, pid, Slurm job id (if
any), start time and command. While the job runs, a thread of rank 0 touches the file every
HEARTBEAT seconds. A second job that finds a live lock stops with one line naming the holder. A
lock is stale when its holder is on this host and its pid is gone, or when its heartbeat is older
than MPI_TP_LOCK_STALE_S seconds (default STALE, several times NFS's attribute caching, for a
holder on another host whose pid cannot be checked), or when it is this very Slurm job's (requeued
after a node failed); a stale lock (a job killed by SIGKILL, a node that died) is taken over with a
message: the rename of the old lock decides which of two takers wins.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import shutil
import socket
import sys
import threading
import time

from mpi_tp.core.errors import UserError

LOCK = ".lock"
HEARTBEAT = 30.0              # seconds between touches of the lock
STALE = 300.0                 # seconds without a heartbeat after which another host's lock is stale
RUN_FILES = ("metrics.jsonl", "config.json", "run.json")


def stale_after() -> float:
    text = os.environ.get("MPI_TP_LOCK_STALE_S", "")
    try:
        return float(text) if text else STALE
    except ValueError:
        raise UserError(f"MPI_TP_LOCK_STALE_S={text!r}: give seconds, e.g. 300") from None


def new_run_dir(root: str = "runs") -> str:
    """runs/<date-time>, or runs/<date-time>-2, -3 ... when another job made it first (exclusive mkdir)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make {root}/ for the run ({e.strerror or e}): give --out a folder you can write") from None
    for n in range(1, 1000):
        path = os.path.join(root, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise UserError(f"could not make a new folder under {root!r} for {stamp}: pass --out DIR")


def describe_run(out: str) -> str | None:
    """What run the folder holds ('checkpoints to step 20, last written 2026-12-01 20:41'), or None."""
    from mpi_tp import checkpoint as ckpt_io
    steps = ckpt_io.complete_steps(os.path.join(out, "checkpoints"))
    files = [f for f in RUN_FILES if os.path.isfile(os.path.join(out, f))]
    if not steps and not files:
        return None
    paths = [os.path.join(out, f) for f in files] + [os.path.join(out, "checkpoints")] * bool(steps)
    when = datetime.datetime.fromtimestamp(max(os.path.getmtime(p) for p in paths)).strftime("%Y-%m-%d %H:%M")
    what = f"checkpoints to step {max(steps)}" if steps else "a run without checkpoints (" + ", ".join(files) + ")"
    return f"{what}, last written {when}"


class RunLock:
    """This job's hold on a run folder: OUT/.lock, kept fresh by a heartbeat thread until release()."""

    def __init__(self, out: str, took_over: str | None = None):
        self.out, self.path, self.took_over = out, os.path.join(out, LOCK), took_over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="mpi_tp run lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            try:
                os.utime(self.path)
            except OSError:
                return                                   # taken away: nothing left to keep fresh

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still this job's."""
        if self._stop.is_set():
            return
        atexit.unregister(self.release)
        self._stop.set()
        holder = read_lock(self.path)
        if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            try:
                os.remove(self.path)
            except OSError:
                pass


def read_lock(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _holder_text(holder: dict | None, age: float) -> str:
    if holder is None:
        return f"an unreadable lock (last touched {age:.0f} s ago)"
    job = f", Slurm job {holder['job']}" if holder.get("job") else ""
    return (f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')} "
            f"(heartbeat {age:.0f} s ago)")


def _alive(pid: int) -> bool:
    """Whether process pid runs on this host (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _is_stale(holder: dict | None, age: float) -> bool:
    job = os.environ.get("SLURM_JOB_ID")
    if holder is not None and job and holder.get("job") == job:
        return True                                      # this very Slurm job, requeued: its old run is over
    if holder is not None and holder.get("host") == socket.gethostname():
        try:
            return not _alive(int(holder["pid"]))
        except (ValueError, KeyError, TypeError):
            pass
    return age > stale_after()


def _create_lock(path: str) -> None:
    """Create the lock file exclusively, with this job's identity (FileExistsError if there is one)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    info = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
            "started": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)


def lock(out: str) -> RunLock:
    """Take OUT/.lock, or take over a stale one (saying so); a live one stops this job with a UserError."""
    path, took_over = os.path.join(out, LOCK), None
    for _ in range(3):
        try:
            _create_lock(path)
            return RunLock(out, took_over)
        except FileExistsError:
            pass
        holder = read_lock(path)
        try:
            age = time.time() - os.path.getmtime(path)
        except OSError:
            continue                                     # released meanwhile: try again
        if not _is_stale(holder, age):
            raise UserError(f"--out {out} is in use by another job: {_holder_text(holder, age)}; wait for it to "
                            "end, or pass another --out")
        aside = f"{path}.stale-{os.getpid()}"
        try:
            os.rename(path, aside)                       # only one taker can move it
        except OSError:
            continue
        os.remove(aside)
        took_over = f"took over the lock of {out} left by {_holder_text(holder, age)}: that job is gone"
    raise UserError(f"could not lock --out {out}: other jobs keep taking it; pass another --out")


def claim(out: str | None, resume: bool, overwrite: bool) -> tuple[str, RunLock, list[str]]:
    """The folder of this run, locked for this job, and what to tell the user; refuses a folder that holds
    another run unless resume (continue it) or overwrite (move it aside first)."""
    notes = []
    if not out:
        out = new_run_dir()
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder {out!r} ({e.strerror}); pass --out DIR") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"output folder {out!r} is not writable; pass --out DIR")
    held = lock(out)
    if held.took_over:
        notes.append(held.took_over)
    try:
        there = describe_run(out)
        if there and not resume:
            if not overwrite:
                raise UserError(f"--out {out} holds a run already ({there}): continue it with --resume, or start "
                                "afresh with --overwrite (which moves it aside)")
            aside = f"{out.rstrip(os.sep)}.replaced-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
            os.makedirs(aside)
            for name in os.listdir(out):
                if name != LOCK:
                    shutil.move(os.path.join(out, name), os.path.join(aside, name))
            notes.append(f"--overwrite: moved the run that was in {out} ({there}) to {aside}")
    except UserError as e:
        held.release()
        if held.took_over:                               # said, or it would go unsaid
            raise UserError(f"{e} (before that, this job {held.took_over})", e.status) from None
        raise
    except BaseException:
        held.release()
        raise
    return out, held, notes
