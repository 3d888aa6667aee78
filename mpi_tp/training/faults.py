"""Pre-emption: SIGTERM turned into a step boundary that every rank agrees on.

Slurm asks a job to stop with SIGTERM (scancel, time limit with
`--signal=TERM@60`, pre-emption). `Preemption` turns the signal into a flag;
after each step the ranks agree on it (one 4-byte all-reduce, so that a signal
that reached some ranks only still stops all of them at the same step), and the
training loop saves a checkpoint and exits cleanly; `--resume` continues.
Non-finite losses and gradients are handled by the loop (--on-nonfinite).
"""
from __future__ import annotations

import signal

import numpy
from mpi4py import MPI


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
