"""Failpoints: faults made to happen at an exact place, so that tests can prove recovery.

MPI_TP_FAILPOINT=name[:STEP][,name[:STEP]...] arms the named points below:

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
    wanted = os.environ.get("MPI_TP_FAILPOINT", "").split(",")
    return name in wanted or f"{name}:{step}" in wanted


def failpoint(name: str, step: int) -> None:
    """SIGKILL this process here when armed, as a crash or an out-of-memory kill would."""
    if armed(name, step):
        os.kill(os.getpid(), signal.SIGKILL)
