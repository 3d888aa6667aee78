"""The stand-in's CUDA devices: which one is current, and the error CUDA gives for one that is not there
(mpi_tp.core.standin: the modules and the arrays both name them)."""
from __future__ import annotations

from mpi_tp.core.standin.counters import counters
from mpi_tp.core.standin.state import settings


class CUDARuntimeError(RuntimeError):
    pass


class Device:
    current = 0

    def __init__(self, device=None):
        self.id = Device.current if device is None else int(device)

    def use(self):
        if not 0 <= self.id < settings.devices:
            raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
        Device.current = self.id

    def synchronize(self):
        counters.sync("device.synchronize")

    def __enter__(self):
        self._before = Device.current
        self.use()
        return self

    def __exit__(self, *exc):
        Device.current = self._before

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __repr__(self):
        return f"<CUDA Device {self.id} (stand-in)>"
