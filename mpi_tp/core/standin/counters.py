"""What the stand-in counts: the operations that cost on a GPU and are free on a CPU.

    from mpi_tp.core.standin import counters
    counters.reset()
    ...                                     # a training step under the stand-in
    counters.syncs, counters.uploads, counters.pinned_bytes, counters.kernels
    counters.sync_sites                     # Counter: 'training/optimizer_state.py:grad_norm' -> 12
    counters.snapshot()                     # all of it as a dict (plain numbers and dicts)

- syncs: the host waits for the device: asnumpy, .get, float()/int()/bool()/.item()/.tolist()
  and printing a device array, a stream's or device's synchronize, and the implicit ones of
  CuPy itself (an output whose size depends on the data: nonzero, a boolean mask, bincount).
- uploads (and upload_bytes): host data copied to the device: asarray of host data, .set,
  host index arrays and host values assigned into a device array.
- downloads (and download_bytes): device data copied to the host (each also a sync).
- pinned_allocs, pinned_bytes: page-locked host buffers made (cupyx.empty_pinned and kin);
  pinned_live_bytes: those still referenced (a pool that keeps buffers keeps them live);
  pinned_peak_bytes: the most live at once since the reset.
- kernels: device operations that may launch a kernel (an upper bound: every ufunc, every
  function or method that computes, every copying index); kernel_names by name.
- atomics: float additions that race on a GPU (cupyx.scatter_add, ufunc.at on floats): not
  bitwise reproducible there.
- mpi_device_buffers, mpi_device_calls: device buffers handed to MPI directly (CUDA-aware MPI),
  in all and by MPI call; mpi_refusals (by call) and last_refusal (why): those refused, unstaged
  without CUDA-aware MPI, or given to a non-blocking collective (mpi_tp.core.standin.state).

Syncs, uploads and atomics keep `*_sites`: where they happened, the first caller outside the
stand-in and mpi_tp/core/backend.py, as 'folder/file.py:function' (relative to mpi_tp/ when
inside it); syncs also `sync_stacks`, that caller and seven above it ('core/gpu.py:lend <
parallel/collectives.py:iall_reduce < ...'). A blocking copy to the host is a sync; one with
blocking=False only a download. `wait_seconds` (a setting, 0 by default): a sync after kernels
were queued sleeps that long, standing for the wait for them, so that timings can be checked.
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter

_HERE = os.path.dirname(os.path.abspath(__file__))
_BACKEND = os.path.join(os.path.dirname(_HERE), "backend.py")
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))


def _where(f) -> str:
    path = os.path.abspath(f.f_code.co_filename)
    where = os.path.relpath(path, _PACKAGE) if path.startswith(_PACKAGE + os.sep) else os.path.basename(path)
    return f"{where}:{f.f_code.co_name}"


def _stack(depth: int = 8) -> list[str]:
    """['core/gpu.py:lend', 'parallel/collectives.py:iall_reduce', ...]: the callers, innermost first, from
    the first frame outside the stand-in and the backend module, `depth` of them at most."""
    f, out = sys._getframe(2), []
    while f is not None and len(out) < depth:
        path = os.path.abspath(f.f_code.co_filename)
        if out or (not path.startswith(_HERE) and path != _BACKEND):
            out.append(_where(f))
        f = f.f_back
    return out or ["?"]


class Counters:
    """The counts since the last reset(); see the module's docstring for each field."""

    FIELDS = ("syncs", "uploads", "upload_bytes", "downloads", "download_bytes", "pinned_allocs", "pinned_bytes",
              "pinned_live_bytes", "pinned_peak_bytes", "kernels", "atomics", "mpi_device_buffers", "last_refusal")

    def __init__(self):
        self.pinned_live_bytes = 0         # survives reset(): live buffers stay live
        self.wait_seconds = 0.0            # a sync after kernels were queued sleeps this long (a setting)
        self._queued = False
        self.reset()

    def reset(self) -> None:
        for name in self.FIELDS:
            if name != "pinned_live_bytes":
                setattr(self, name, 0)
        self.last_refusal = ""
        self.pinned_peak_bytes = self.pinned_live_bytes
        self.sync_reasons, self.sync_sites, self.sync_stacks = Counter(), Counter(), Counter()
        self.upload_sites, self.kernel_names, self.atomic_sites = Counter(), Counter(), Counter()
        self.mpi_device_calls, self.mpi_refusals = Counter(), Counter()
        self.paused = 0                    # > 0 inside a fused kernel: its parts are not counted

    # -- recording (called by the stand-in) ------------------------------------------------

    def sync(self, reason: str, nbytes: int = 0, blocking: bool = True) -> None:
        """The host waits for the device (or, blocking=False, only queues a copy to the host)."""
        if nbytes:
            self.downloads += 1
            self.download_bytes += int(nbytes)
        if not blocking:
            return
        stack = _stack()
        self.syncs += 1
        self.sync_reasons[reason] += 1
        self.sync_sites[stack[0]] += 1
        self.sync_stacks[" < ".join(stack)] += 1
        if self._queued and self.wait_seconds:
            time.sleep(self.wait_seconds)          # the queued kernels' time, for timing tests
        self._queued = False

    def upload(self, nbytes: int) -> None:
        self.uploads += 1
        self.upload_bytes += int(nbytes)
        self.upload_sites[_stack(1)[0]] += 1

    def kernel(self, name: str) -> None:
        self._queued = True
        if not self.paused:
            self.kernels += 1
            self.kernel_names[name] += 1

    def atomic(self, name: str) -> None:
        self.atomics += 1
        self.atomic_sites[f"{_stack(1)[0]} ({name})"] += 1

    def pinned(self, nbytes: int) -> None:
        self.pinned_allocs += 1
        self.pinned_bytes += int(nbytes)
        self.pinned_live_bytes += int(nbytes)
        self.pinned_peak_bytes = max(self.pinned_peak_bytes, self.pinned_live_bytes)

    def pinned_freed(self, nbytes: int) -> None:
        self.pinned_live_bytes -= int(nbytes)

    def mpi_device(self, call: str) -> None:
        self.mpi_device_buffers += 1
        self.mpi_device_calls[call] += 1

    def mpi_refused(self, call: str, why: str) -> None:
        self.mpi_refusals[call] += 1
        self.last_refusal = why

    # -- reading ---------------------------------------------------------------------------

    def syncs_outside(self, *files: str) -> int:
        """Syncs whose site is in none of `files` (e.g. 'core/gpu.py': leave out MPI staging's)."""
        return sum(n for site, n in self.sync_sites.items() if site.split(":")[0] not in files)

    def syncs_under(self, *sites: str) -> int:
        """Syncs with one of `sites` ('file.py:function', or a file) among their callers (sync_stacks)."""
        return sum(n for stack, n in self.sync_stacks.items()
                   if any(s == site or s.split(":")[0] == site for s in stack.split(" < ") for site in sites))

    def snapshot(self) -> dict:
        out = {name: getattr(self, name) for name in self.FIELDS}
        for name in ("sync_reasons", "sync_sites", "sync_stacks", "upload_sites", "kernel_names", "atomic_sites",
                     "mpi_device_calls", "mpi_refusals"):
            out[name] = dict(getattr(self, name))
        return out

    def __repr__(self) -> str:
        return "Counters(" + ", ".join(f"{k}={getattr(self, k)}" for k in self.FIELDS) + ")"


counters = Counters()
