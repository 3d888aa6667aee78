"""The one error type raised on purpose: bad input, a damaged file, a full disk, a layout that cannot work.

Its message is the whole story (printed once, without a traceback; see
mpi_tp.core.runtime); anything else that escapes is a bug and shows its
traceback. Each part of the package has its own kind (ConfigError,
TopologyError, DataError, CheckpointError, BackendError), all UserErrors.
"""
from __future__ import annotations


class UserError(Exception):
    """Raised on purpose: what was asked cannot be done, and the message says why and what to do.

    Printed without a traceback (the message is the whole story); the command
    exits with `status`. Every error type we raise for bad input subclasses it.
    """

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def refuse_to_replace(path: str, overwrite: bool, what: str) -> None:
    """No command replaces a file or folder that exists unless asked (--overwrite): say so in one line."""
    import os
    if path and os.path.lexists(path) and not overwrite:
        raise UserError(f"{what}: {path} exists already: pass --overwrite to replace it, or another name")
