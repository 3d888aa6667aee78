"""What a long job meets: pre-emption (SIGTERM), non-finite numbers, and failpoints to test both.

Pre-emption. Slurm asks a job to stop with SIGTERM (scancel, time limit with
`--signal=TERM@60`, pre-emption). `Preemption` turns the signal into a flag;
after each step the ranks agree on it (one 4-byte all-reduce, so that a signal
that reached some ranks only still stops all of them at the same step), and the
training loop saves a checkpoint and exits cleanly; `--resume` continues.

Failpoints. MPI_TP_FAILPOINT=name[:STEP] arms one of the named points below,
which tests use to make a crash or a fault happen at an exact place:

    save-during-shards, save-before-index,       SIGKILL inside a checkpoint save
    save-before-rename, save-before-latest
    sigterm                                      send this process SIGTERM after the step
    nan-grad                                     poison a gradient with NaN after the backward pass
"""
from __future__ import annotations

import os
import signal

import numpy
from mpi4py import MPI


def armed(name: str, step: int) -> bool:
    """True when MPI_TP_FAILPOINT names this point (for every step, or for this step)."""
    want = os.environ.get("MPI_TP_FAILPOINT")
    return bool(want) and want in (name, f"{name}:{step}")


def failpoint(name: str, step: int) -> None:
    """SIGKILL this process here when armed, as a crash or an out-of-memory kill would."""
    if armed(name, step):
        os.kill(os.getpid(), signal.SIGKILL)


class Preemption:
    """SIGTERM -> a flag that every rank of `comm` sees at the same step boundary."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.requested = comm, False
        self._flag = numpy.zeros(1, dtype=numpy.int32)
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Collective: True on every rank if any rank received SIGTERM."""
        self._flag[0] = int(self.requested)
        self.comm.Allreduce(MPI.IN_PLACE, self._flag, op=MPI.MAX)
        return bool(self._flag[0])

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)
