"""The stand-in's settings, and its rule for handing a device array to MPI.

mpi4py takes a buffer from an object by the buffer protocol, else `__dlpack__`,
else `__cuda_array_interface__` (a device pointer). A stand-in array offers none
of the first two, and the third only when MPI was declared CUDA-aware
(`cuda_aware`, what mpi_tp.core.gpu.cuda_aware_mpi() answered when the stand-in was
installed: MPI_TP_CUDA_AWARE=1 on a machine without CUDA). The pointer is a host
one, which the host MPI library reads correctly, and each hand-over is counted.
Otherwise mpi4py gets a TypeError saying that the buffer was not staged.

With `nonblocking_collectives` False (the default) the stand-in also keeps Open
MPI 4.x's rule: device pointers only in point-to-point calls and blocking
collectives. Which MPI call is asking is read from the calling line (the call
expression at the caller's current instruction, e.g. `self.comm.Iallreduce(...)`).
"""
from __future__ import annotations

import linecache
import os
import re
import sys

from mpi_tp.core.standin.counters import counters


class Settings:
    """devices: what cupy.cuda.runtime.getDeviceCount() answers; fail_ranks: the COMM_WORLD ranks whose
    getDeviceCount() raises (a GPU that fails to start); cuda_aware, nonblocking_collectives: see above."""

    def __init__(self):
        self.devices = int(os.environ.get("MPI_TP_CUPY_STANDIN_DEVICES", "1"))
        ranks = os.environ.get("MPI_TP_CUPY_STANDIN_FAIL_RANKS", "")
        self.fail_ranks = {int(r) for r in ranks.replace(",", " ").split()}
        self.cuda_aware = False
        self.nonblocking_collectives = False


settings = Settings()


class StrictnessError(TypeError):
    """What CuPy (or MPI with device buffers) would refuse or crash on, caught on the host."""


_P2P = {"Isend", "Irecv", "Issend", "Ibsend", "Irsend", "Imrecv", "Iprobe", "Improbe"}
_CALL = re.compile(r"\.\s*([A-Z][A-Za-z_]*)\s*\(")


def mpi_call_name() -> str:
    """The MPI method being called where the stand-in was asked for a device pointer ('?' if unclear)."""
    f = sys._getframe(1)
    here = os.path.dirname(os.path.abspath(__file__))
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(here):
        f = f.f_back
    if f is None:
        return "?"
    text = linecache.getline(f.f_code.co_filename, f.f_lineno)
    positions = getattr(f.f_code, "co_positions", None)     # Python 3.11+: the span of the call itself
    if positions is not None and f.f_lasti >= 0:
        start, end, col, end_col = list(positions())[f.f_lasti // 2]
        if None not in (start, end, col, end_col):
            lines = [linecache.getline(f.f_code.co_filename, n) for n in range(start, end + 1)]
            lines[-1] = lines[-1][:end_col]
            lines[0] = lines[0][col:]
            text = "".join(lines)
    found = _CALL.search(text)
    return found.group(1) if found else "?"


_last = [None]       # the caller's (frame, instruction, array) last asked: mpi4py asks twice per buffer


def device_buffer(a) -> dict:
    """The __cuda_array_interface__ of stand-in array `a` for MPI, or StrictnessError (see the docstring).

    mpi4py turns the error into its own "expecting buffer" TypeError: the reason is kept in
    counters.mpi_refusals (by MPI call) and counters.last_refusal."""
    call = mpi_call_name()
    problem = None
    if not settings.cuda_aware:
        problem = (f"a device array ({a.dtype}, shape {a.shape}) was handed to MPI ({call}) unstaged, and MPI "
                   "is not CUDA-aware: stage it through host buffers (mpi_tp.core.gpu.Stager) first")
    elif call.startswith("I") and call[1:2].islower() and call not in _P2P and not settings.nonblocking_collectives:
        problem = (f"a device array was handed to the non-blocking collective {call}: Open MPI 4.x takes device "
                   "buffers only in point-to-point calls and blocking collectives; stage it, or use a blocking call")
    caller = sys._getframe(2)
    key = (id(caller), caller.f_lasti, id(a))
    if key != _last[0]:
        _last[0] = key
        if problem is None:
            counters.mpi_device(call)
        else:
            counters.mpi_refused(call, problem)
    if problem is not None:
        raise StrictnessError(problem)
    raw = a._a
    info = dict(raw.__array_interface__)
    return {"shape": info["shape"], "typestr": info["typestr"], "descr": info["descr"],
            "strides": info["strides"], "data": info["data"], "version": 3, "stream": None}
