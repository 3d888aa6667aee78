"""What the collectives hand to MPI: checked contiguous buffers, staged for device arrays, and started
non-blocking operations (`Pending`) that complete into their result.

Used by mpi_tp.parallel.collectives.Group only: a layer never sees these.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

from mpi_tp.core import backend
from mpi_tp.core.precision import is_bf16


def check_buffer(x, what: str) -> None:
    """MPI reads raw memory: refuse views it would misread, before any rank enters the call."""
    if not x.flags.c_contiguous:
        raise ValueError(f"{what}: buffer must be C-contiguous (got strides {x.strides})")
    if x.dtype.kind not in "fiu" and not is_bf16(x):               # bfloat16: parallel.formats
        raise ValueError(f"{what}: unsupported dtype {x.dtype}")


def in_place(call, x, result: bool = True) -> None:
    """call(buf) with the buffer MPI should see for x (x itself, or a lent pinned copy of a device array);
    afterwards x holds what MPI left in buf (when `result`), and buf goes back to the pool."""
    stager = backend.stager()
    buf = stager.lend(x)
    call(buf)
    stager.give_back(x, buf, copy=result)


def out_of_place(call, send, out) -> None:
    """call(send_buf, recv_buf) for MPI reading `send` and writing `out` (both staged as in in_place)."""
    stager = backend.stager()
    send_buf, recv_buf = stager.lend(send), stager.lend(out, copy=False)
    call(send_buf, recv_buf)
    stager.give_back(send, send_buf, copy=False)
    stager.give_back(out, recv_buf)


class Pending:
    """A started non-blocking operation: wait() completes it and returns its result (x itself for an
    all-reduce or a receive, the new array for a gather; a staged GPU buffer is copied back into x
    when MPI wrote it: result=True for an all-reduce or a receive, False for a send).

    then: what turns the completed buffer into the result (e.g. moving the gathered axis back);
    send: (array, buffer) that MPI reads until completion (a gather's or reduce-scatter's input), given
    back to the stager then.
    start, ready: a device array's copy to the host is still in flight (ready: its event, see
    mpi_tp.core.gpu.Stager.lend_started); start() starts the MPI operation once it has landed. test()
    never blocks the host (it starts MPI only when the copy is done, and a finished operation's copy
    back goes on the copy stream), so that calling it inside the backward pass (the data-parallel
    buckets) keeps the GPU busy; wait() blocks.

    Seconds counted (record: (stats, key, t0)): the time inside the start, test(), wait() and cancel()
    only, what the rank was held (CommStats.blocked); the trace shows the whole flight, t0 to completion.
    """

    def __init__(self, request, x, buf, record, result: bool = True, then=None, send=None, start=None,
                 ready=None):
        self.request, self.x, self.buf, self._record = request, x, buf, record   # buf: lent by the stager
        self.result, self._then, self.value, self._send = result, then, x, send
        self._start, self._ready, self.finished = start, ready, request is None and start is None
        if start is not None and ready is None:
            with self._blocked():
                self._begin()

    def _blocked(self):
        return nullcontext() if self._record is None else self._record[0].blocked(self._record[1])

    def _begin(self) -> None:
        self.request, self._start = self._start(), None

    def test(self) -> bool:
        """Let MPI make progress; True once the operation is complete (and then finished as wait() does,
        but with the copy back to the device left on the copy stream)."""
        if self.finished:
            return True
        if self._start is not None and not self._ready.done:
            return False
        with self._blocked():
            if self._start is not None:
                self._begin()
            if self.request.Test():
                self._done(blocking=False)
        return self.finished

    def wait(self):
        if not self.finished:
            if self._start is not None:
                self._ready.synchronize()       # the device's copy: not communication yet
            with self._blocked():
                if self._start is not None:
                    self._begin()
                self.request.Wait()
                self._done(blocking=True)
        return self.value

    def cancel(self) -> None:
        """Withdraw a receive that is no longer wanted (a pipeline run that failed part-way), so that it
        cannot match a later message; completes the request whether or not a message had arrived."""
        if not self.finished and self.request is not None:
            with self._blocked():
                self.request.Cancel()
                self.request.Wait()
            backend.stager().give_back(self.x, self.buf, copy=False)
            if self._send is not None:
                backend.stager().give_back(*self._send, copy=False)
            self.finished = True

    def _done(self, blocking: bool) -> None:
        backend.stager().give_back(self.x, self.buf, copy=self.result, blocking=blocking)
        if self._send is not None:
            backend.stager().give_back(*self._send, copy=False)
        if self._then is not None:
            self.value = self._then(self.x)
        stats, key, t0 = self._record
        now = time.perf_counter()
        if stats.trace is not None:                              # the flight, from start to completion
            stats.trace.complete(key, "comm", t0, now, bytes=int(self.x.nbytes))
        self.finished = True


def axis_first(x, axis: int, xp):
    """x with `axis` moved to the front, contiguous: MPI's blocks are rank-major along axis 0."""
    return x if axis % x.ndim == 0 else xp.ascontiguousarray(xp.moveaxis(x, axis, 0))


def axis_back(out, axis: int, ndim: int, xp):
    """Undo axis_first on a result of the same number of dimensions."""
    return out if axis % ndim == 0 else xp.ascontiguousarray(xp.moveaxis(out, 0, axis))


def displacements(counts: list[int]) -> list[int]:
    """Where each rank's block starts: displacements([2, 0, 3]) == [0, 2, 2]."""
    return [sum(counts[:r]) for r in range(len(counts))]
