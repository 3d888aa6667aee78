"""Failpoints: faults made to happen at an exact place, so that tests can prove recovery.

MPI_TP_FAILPOINT=name[:STEP] arms one of the named points below:

    save-during-shards, save-before-index,       SIGKILL inside a checkpoint save
    save-before-rename, save-before-latest
    sigterm                                      send this process SIGTERM after the step
    nan-grad                                     poison a gradient with NaN after the backward pass
"""
from __future__ import annotations

import os
import signal


def armed(name: str, step: int) -> bool:
    """True when MPI_TP_FAILPOINT names this point (for every step, or for this step)."""
    want = os.environ.get("MPI_TP_FAILPOINT")
    return bool(want) and want in (name, f"{name}:{step}")


def failpoint(name: str, step: int) -> None:
    """SIGKILL this process here when armed, as a crash or an out-of-memory kill would."""
    if armed(name, step):
        os.kill(os.getpid(), signal.SIGKILL)
