"""What a checkpoint looks like on disk: names, format version, and the helpers both halves share."""
from __future__ import annotations

import hashlib
import os
import shutil

import numpy

from mpi_tp.core.errors import UserError
from mpi_tp.core.precision import bfloat16, is_bf16
from mpi_tp.parallel.fsdp import whole_params

FORMAT = "mpi_tp-checkpoint"
VERSION = 1


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read or does not fit; the message names the file and the fix."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_name(rank: int, size: int) -> str:
    return f"shard-{rank:02d}-of-{size:02d}.h5"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def put_in_place(new: str, final: str) -> None:
    """Rename the complete folder `new` to `final`. A `final` already there is moved aside to final.old
    first and removed only once the new one is in place, so a failure never leaves neither."""
    if os.path.lexists(final):
        old = final.rstrip(os.sep) + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(new, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(new, final)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def state_tensors(model, optimizer):
    """(group, Param, array) for every tensor saved: model/<name> (the parameters, then the buffers: state
    without a gradient, e.g. an MoE block's expert bias), optim/<kind>/<name>.

    Each parameter once: a pipeline stage's copy of the tied table (the output layer's) is
    left out, since the first stage saves the same numbers. ZeRO-3: the parameters are gathered whole
    (collective over dp; the arrays returned are the gathered copies)."""
    params = model.unique_parameters()
    keep = {id(p) for p in params}
    with whole_params(model):
        out = [("model", p, p.data) for p in params]
    out += [("model", b, b.data) for b in model.buffers()]
    if optimizer is not None:
        for kind, arrays in optimizer.state_tensors().items():
            out += [(f"optim/{kind}", p, a) for p, a in zip(optimizer.params, arrays) if id(p) in keep]
    return out


def complete_steps(root: str) -> list[int]:
    """Steps under root whose directory is complete (renamed into place, index present), oldest first."""
    steps = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("step-") and name[5:].isdigit() and \
                    os.path.isfile(os.path.join(root, name, "index.h5")):
                steps.append(int(name[5:]))
    return sorted(steps)


# bfloat16 on disk: HDF5 has no bfloat16 type (h5py would store ml_dtypes' arrays as opaque 2-byte
# records), so a bfloat16 tensor is stored as its uint16 words, the index naming its dtype "bfloat16";
# any reader gets the exact values as (words.astype(uint32) << 16).view(float32).

def dtype_name(dtype) -> str:
    """What the index records as a tensor's dtype: NumPy's string ('<f4'), or 'bfloat16'."""
    return "bfloat16" if is_bf16(dtype) else numpy.dtype(dtype).str


def stored(array):
    """The array as HDF5 holds it: a bfloat16 array's uint16 words (a view), anything else itself."""
    return array.view(numpy.uint16) if is_bf16(array) else array


def stored_dtype(name: str):
    """The dtype on disk for a dtype_name (bfloat16: uint16)."""
    return numpy.dtype(numpy.uint16) if name == "bfloat16" else numpy.dtype(name)


def as_saved(values, name: str):
    """Values read from disk as the dtype the index names (bfloat16: the uint16 words viewed back)."""
    return values.view(bfloat16()) if name == "bfloat16" else values
