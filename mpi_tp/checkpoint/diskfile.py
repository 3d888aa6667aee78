"""The file object that checkpoint files are written through, so that a full disk is an error, not a crash."""
from __future__ import annotations

import os


class DiskFile:
    """The file object HDF5 writes a checkpoint file through (h5py takes one in place of a name).

    HDF5 does not survive a failed write: h5py prints the error from a destructor instead of
    raising it, and closing the file afterwards can crash the process (seen with ENOSPC, h5py
    3.16, HDF5 2.0). So a write that fails is kept here, not passed on: it and every later write
    are dropped, HDF5 finishes and closes the file as if all went well, and `close` raises the
    error. Unbuffered, so that the error is the failing write's own (a buffered file raises it
    later, from a seek). After an error the writers stop adding datasets; what HDF5 reads back
    of a dropped write (zeros: h5py fills short reads) only goes into a file that is deleted.
    """

    def __init__(self, path: str, fault=None):
        self.path = path
        self.error: OSError | None = None
        self.fault = fault                       # a failpoint called before each write (tests)
        self.raw = open(path, "w+b", buffering=0)

    def write(self, data) -> None:
        if self.error is not None:
            return
        try:
            if self.fault is not None:
                self.fault()
            view = memoryview(data).cast("B")
            while view:                          # a raw write may take fewer bytes than offered
                view = view[self.raw.write(view):]
        except OSError as e:
            self.error = e

    def truncate(self, size: int) -> None:
        if self.error is None:
            try:
                self.raw.truncate(size)
            except OSError as e:
                self.error = e

    def flush(self) -> None:                     # nothing waits in memory; close() fsyncs
        pass

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def read(self, size: int = -1) -> bytes:      # h5py knows a file object by read and seek
        return self.raw.read(size)

    def readinto(self, buf) -> int:
        return self.raw.readinto(buf)

    def close(self) -> None:
        """fsync and close the file; raise the first failed write's error, if there was one."""
        try:
            if self.error is None:
                os.fsync(self.raw.fileno())
        except OSError as e:
            self.error = e
        finally:
            self.raw.close()
        if self.error is not None:
            raise OSError(self.error.errno, self.error.strerror, self.path) from self.error
