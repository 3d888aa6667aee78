"""Failpoints: faults made to happen at an exact place, so that tests can prove recovery.

MPI_TP_FAILPOINT=name[:STEP][,name[:STEP]...] arms the named points below:

    save-during-shards, save-before-index,       SIGKILL inside a checkpoint save
    save-before-rename, save-before-latest
    save-enospc                                  the disk is full halfway through the last
                                                 tensor-parallel rank's shard (ENOSPC); the other
                                                 ranks' shards are written
    save-enospc-index                            the disk is full when rank 0 writes the index
    sigterm                                      send this process SIGTERM after the step
    nan-grad                                     poison a gradient with NaN after the backward pass
    overflow                                     fp16 runs: the world's last rank alone writes inf into
                                                 a gradient after the backward pass, as an overflow
                                                 would (mpi_tp.training.loss_scale)
    sample-error:SEED                            rank 0's sampling fails (a RuntimeError) at the third
                                                 byte of every request with this seed (serving tests)
    answer-error:SEED                            the HTTP thread answering a request with this seed fails
                                                 (a RuntimeError, not an OSError) after its second token

Planted bugs (PLANTED below): the classic mistakes of a parallel implementation, each switched on by
its name (MPI_TP_FAILPOINT=bug-f-backward), for `mpi-tp verify` to find and name, and for a learner to
watch it do so. Each breaks only what a parallel layout does (a collective skipped, a shard's offset,
the micro-batches' share), so the serial reference verify runs beside it stays right.
"""
from __future__ import annotations

import errno
import functools
import os
import signal

PLANTED = {
    "bug-f-backward": "f's backward returns this rank's partial dX: no all-reduce (tensor parallelism, no sp)",
    "bug-bias-before-reduce": "the row-parallel layers add their replicated bias before the sum over tp: T copies",
    "bug-vocab-offset": "the vocabulary-parallel embedding looks its ids up one row off (its shard's offset one "
                        "too low)",
    "bug-dropout-replay": "recomputation draws the next step's dropout masks instead of replaying the pass's",
    "bug-micro-batch-scale": "each micro-batch's gradient is not divided by the number of micro-batches",
    "bug-sp-grads": "under sequence parallelism the replicated parameters' gradients (norms, row biases, the "
                    "position table) are not summed over tp",
    "bug-tied-embedding": "the tied embedding's two copies (first and last pipeline stage) are not summed",
}


def armed(name: str, step: int) -> bool:
    """True when MPI_TP_FAILPOINT names this point (for every step, or for this step)."""
    wanted = os.environ.get("MPI_TP_FAILPOINT", "").split(",")
    return name in wanted or f"{name}:{step}" in wanted


@functools.cache
def _armed_names(setting: str) -> frozenset:
    return frozenset(setting.split(","))


def planted(bug: str) -> bool:
    """True when MPI_TP_FAILPOINT plants this bug (one of PLANTED). Cheap: called on hot paths."""
    return bug in _armed_names(os.environ.get("MPI_TP_FAILPOINT", ""))


def failpoint(name: str, step: int) -> None:
    """SIGKILL this process here when armed, as a crash or an out-of-memory kill would."""
    if armed(name, step):
        os.kill(os.getpid(), signal.SIGKILL)


def no_space(name: str, step: int, path: str) -> None:
    """Raise ENOSPC here when armed, as a write to a full disk would."""
    if armed(name, step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def sample_error(seed: int, chosen: int) -> None:
    """Raise here, in rank 0's sampling, at a request's third byte when armed for its seed."""
    if chosen == 2 and f"sample-error:{seed}" in os.environ.get("MPI_TP_FAILPOINT", "").split(","):
        raise RuntimeError(f"failpoint sample-error:{seed}")


def answer_error(seed: int, sent: int) -> None:
    """Raise here, in the HTTP thread answering a request, after its second token when armed for its seed."""
    if sent == 2 and f"answer-error:{seed}" in os.environ.get("MPI_TP_FAILPOINT", "").split(","):
        raise RuntimeError(f"failpoint answer-error:{seed}")
