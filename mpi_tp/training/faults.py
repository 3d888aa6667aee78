"""Pre-emption: a stop signal turned into a step boundary that every rank agrees on.

Slurm asks a job to stop with SIGTERM (scancel, time limit with
`--signal=TERM@60`, pre-emption); SIGUSR1 does the same, for a launcher that
forwards only it (Open MPI's mpiexec: mpi_tp.core.runtime.STOP_SIGNALS).
`Preemption` turns the signal into a flag; after each step the ranks agree on
it (one 4-byte all-reduce, so that a signal that reached some ranks only still
stops all of them at the same step), and the training loop saves a checkpoint
and exits cleanly; `--resume` continues. Non-finite losses and gradients are
handled by the loop (--on-nonfinite).
"""
from __future__ import annotations

import signal

import numpy
from mpi4py import MPI

from mpi_tp.core.runtime import STOP_SIGNALS


class Preemption:
    """A stop signal (SIGTERM, SIGUSR1) -> a flag that every rank of `comm` sees at the same step boundary."""

    def __init__(self, comm: MPI.Comm):
        self.comm, self.requested = comm, 0                  # the signal's number, 0: none
        self._flag = numpy.zeros(1, dtype=numpy.int32)
        self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.requested = int(signum)

    def agreed(self) -> str | None:
        """Collective: on every rank, the name of a stop signal that some rank received ('SIGTERM'), or None."""
        self._flag[0] = self.requested
        self.comm.Allreduce(MPI.IN_PLACE, self._flag, op=MPI.MAX)
        return signal.Signals(int(self._flag[0])).name if self._flag[0] else None

    def close(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
