"""Writing checkpoints: each rank writes its own shard, an index stitches the full view.

A checkpoint root holds one directory per saved step and a `latest` pointer:

    ROOT/latest                       text: the name of the newest complete step directory
    ROOT/step-00000020/
        shard-00-of-02.h5             tensor-parallel rank 0's slices (+ the replicated tensors)
        shard-01-of-02.h5             rank 1's slices
        index.h5                      format version, configs, layout, step, random state,
                                      and every full tensor as an HDF5 virtual dataset

Shards are numbered (ep rank, pipeline stage, tensor-parallel rank), tensor-parallel
fastest: shard-{(e * pp + s) * tp + t}-of-{ep * pp * tp}, the names of before when
ep = 1. Dense tensors are written by the first data-parallel replica (dp rank 0),
a mixture-of-experts layer's experts, held by one member of each expert-parallel
group, by the first replica holding them (edp rank 0: the members of the first ep
group), so every expert is written once, into the shards of its owner's ep rank.

`h5py.File("ROOT/step-00000020/index.h5")["model/h/0/attn/q/weight"][...]` is the
full (C, C) matrix, read from the shards by HDF5 itself. docs/checkpoints.md
describes the format.

Nothing is lost: shards and index are written into `ROOT/.step-N.tmp`, fsynced,
and only then is the directory renamed to `step-N` (atomic) and `latest`
replaced (atomic). A process killed at any moment leaves the previous
checkpoint complete and `latest` naming it. Old steps are deleted only after a
newer one is complete.

Loading reads, on each rank, only the slices its shards need (hyperslab reads
from the shard files), so a checkpoint saved at one tensor-parallel size loads
at any other. Every dataset carries a Fletcher-32 checksum; the index records
each shard's size and SHA-256, which `verify` checks in full.

A full disk is checked for before writing (the estimated size against the free
space) and at every write (through `DiskFile`): the save stops on every rank
with one CheckpointError saying what to do, `.step-N.tmp` is removed, and the
previous checkpoint stays `latest`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil

import h5py
import numpy

from mpi_tp.checkpoint.diskfile import DiskFile
from mpi_tp.checkpoint.format import (
    FORMAT,
    VERSION,
    CheckpointError,
    complete_steps,
    dtype_name,
    fsync_path,
    put_in_place,
    sha256_file,
    shard_name,
    state_tensors,
    step_dir_name,
    stored,
    stored_dtype,
)
from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.core.failpoints import failpoint, no_space
from mpi_tp.core.runtime import collective_setup
from mpi_tp.parallel.expert_parallel import expert_of

# HDF5's own bytes per dataset in a shard: 3.5-4.8 KiB measured (h5py 3.16, HDF5 2.0). Counting a
# little less, and not the index, the check before writing never refuses a save that would fit.
HDF5_BYTES_PER_DATASET = 3 * 1024


def _estimate(arrays) -> int:
    """Bytes that these arrays take as checkpoint datasets, about (a little less, if anything)."""
    return sum(int(a.nbytes) + HDF5_BYTES_PER_DATASET for a in arrays)


def _no_room(root: str, step: int, what: str, needed: int, free: int, failed=None) -> CheckpointError:
    where = f" (writing {os.path.basename(failed)} failed)" if failed else ""
    return CheckpointError(
        f"not enough disk space to save step {step} in {root}{where}: {what} needs about {needed:,} bytes "
        f"and {free:,} were free when the save began. The checkpoint named by {root}/latest, if any, is "
        "untouched. Free some space on that disk, point --out at another disk, or keep fewer "
        "checkpoints (--keep).")


@contextlib.contextmanager
def _full_disk_reported(root: str, step: int, what: str, needed: int, free: int):
    """A full disk (ENOSPC, or EDQUOT: over quota) inside becomes one CheckpointError saying what to do."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise _no_room(root, step, what, needed, free, e.filename) from e


def _write_shard(path, tensors, step, fault=None):
    """The tensors this rank writes: its slices of the sharded ones (rank 0: also the replicated ones).

    fault: a failpoint, armed halfway through. On a full disk, stops at once and raises OSError."""
    pieces = {}
    disk = DiskFile(path)
    with contextlib.closing(disk), h5py.File(disk, "w") as f:
        for i, (group, p, data) in enumerate(tensors):
            name = f"{group}/{p.name}"
            ds = f.create_dataset(name, data=stored(backend.asnumpy(data)), fletcher32=True)   # bf16: its words
            ds.attrs["global_shape"] = p.global_shape
            ds.attrs["axis"] = -1 if p.axis is None else p.axis
            ds.attrs["start"], ds.attrs["stop"] = p.start, p.stop
            pieces[name] = [p.start, p.stop]
            if i == len(tensors) // 2:
                failpoint("save-during-shards", step)
                disk.fault = fault
            if disk.error is not None:           # the rest would be dropped: close, then raise
                break
    return pieces


def _write_index(path, shards, tensors, meta, fault=None, tokenizer_json=None):
    """The index: metadata, the layout table, a virtual dataset per full tensor, and the tokenizer.json
    the model reads text with (if any: meta/tokenizer.json, its text as UTF-8 bytes).

    tensors: (name, global shape, dtype name (format.dtype_name), split axis) of every tensor of every stage."""
    layout = {"shards": shards, "tensors": {}}
    disk = DiskFile(path, fault)
    with contextlib.closing(disk), h5py.File(disk, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = VERSION
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value)
        for name, global_shape, dtype, axis in tensors:
            owners = [(r, s["pieces"][name]) for r, s in enumerate(shards) if name in s["pieces"]]
            layout["tensors"][name] = {"shape": list(global_shape), "dtype": dtype,
                                       "axis": axis, "pieces": [[r, a, b] for r, (a, b) in owners]}
            dtype = stored_dtype(dtype)                          # bfloat16: uint16 words on disk
            vds = h5py.VirtualLayout(shape=tuple(global_shape), dtype=dtype)
            for r, (a, b) in owners:
                shape = list(global_shape)
                idx = [slice(None)] * len(shape)
                if axis is not None:
                    shape[axis] = b - a
                    idx[axis] = slice(a, b)
                vds[tuple(idx)] = h5py.VirtualSource("./" + shards[r]["file"], name, shape=tuple(shape))
            f.create_virtual_dataset(name, vds, fillvalue=numpy.nan if dtype.kind == "f" else 0)
            if disk.error is not None:
                break
        f.create_dataset("meta/layout", data=json.dumps(layout))
        if tokenizer_json is not None:
            f.create_dataset("meta/tokenizer.json", data=numpy.frombuffer(tokenizer_json.encode(), numpy.uint8))


def save(root: str, step: int, model, optimizer=None, meta: dict | None = None, keep: int = 0,
         tokenizer=None) -> str:
    """Save model (and optimizer) state as ROOT/step-N; collective over every rank of the model's topology.

    The first data-parallel replica's tensor-parallel ranks write the shards (the
    other replicas hold the same numbers), and with expert parallelism the first
    ep group's members write their experts too (see the module docstring); every rank
    takes part in the agreements, so an error anywhere (a full disk) raises
    CheckpointError on all of them together.

    meta: JSON-able entries stored as index attributes (config, train_config, rng, data ...).
    keep: keep only the newest `keep` complete steps (0 = keep all). tokenizer: what the model reads text
    with (mpi_tp.text.tokenizer; default bytes), kept in the index. Returns the step directory.
    """
    topo = model.topo
    group, comm, ep = topo.tp, topo.world, topo.ep
    # the first replica's ranks (dp and cp rank 0: the cp ranks hold the same weights) and the first holders of
    # each expert shard (edp rank 0: the rest of that replica's ep group, and with etp != tp other tp ranks)
    writer = (topo.dp.rank == 0 and topo.cp.rank == 0) or topo.edp.rank == 0
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, "." + step_dir_name(step) + ".tmp")
    pointer = os.path.join(root, "latest.tmp")
    tensors = state_tensors(model, optimizer)
    mine = [(g, p, d) for g, p, d in tensors if _writes(p, topo)]
    shard_bytes = _estimate(data for _, _, data in mine)
    total_bytes = comm.allreduce(shard_bytes)        # one int per rank, at save time only

    def prepare():
        if comm.Get_rank() != 0:
            return None
        os.makedirs(root, exist_ok=True)
        _clean_debris(root)
        free = shutil.disk_usage(root).free
        if total_bytes > free:                       # sure not to fit: say so before writing anything
            raise _no_room(root, step, "the checkpoint", total_bytes, free)
        os.makedirs(tmp)
        return free
    pp = topo.pp                                      # one shard per (ep rank, stage, tensor-parallel rank)
    fname = shard_name((ep.rank * pp.size + pp.rank) * group.size + group.rank, ep.size * pp.size * group.size)
    if topo.etp is not topo.tp:                       # the experts' own grid (mpi_tp.parallel.expert_grid)
        fname = shard_name(comm.Get_rank(), comm.Get_size())

    def write():
        if not writer:
            return None
        path = os.path.join(tmp, fname)
        last = group.rank == group.size - 1 and pp.rank == pp.size - 1 and ep.rank == ep.size - 1
        fault = (lambda: no_space("save-enospc", step, path)) if last else None
        with _full_disk_reported(root, step, "this rank's shard", shard_bytes, shutil.disk_usage(tmp).free):
            pieces = _write_shard(path, mine, step, fault)
            return {"file": fname, "bytes": os.path.getsize(path), "sha256": sha256_file(path), "pieces": pieces}

    def publish():
        if comm.Get_rank() != 0:
            return
        info = dict(meta or {})
        info.update(step=step, layout=model.topo.layout.to_dict(), dtypes=str(model.dtype))
        if tokenizer is not None:
            info["tokenizer"] = tokenizer.describe()
        with _full_disk_reported(root, step, "the checkpoint", total_bytes, free_at_start):
            index = os.path.join(tmp, "index.h5")
            _write_index(index, shards, described, info, lambda: no_space("save-enospc-index", step, index),
                         getattr(tokenizer, "json_text", None))
            fsync_path(tmp)
            failpoint("save-before-rename", step)
            put_in_place(tmp, final)            # re-saving a step: the old copy goes once the new is there
            fsync_path(root)
            failpoint("save-before-latest", step)
            with open(pointer, "w") as f:
                f.write(step_dir_name(step) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(pointer, os.path.join(root, "latest"))
            fsync_path(root)
        if keep > 0:   # the step just written always stays, with the keep - 1 highest others
            others = [s for s in complete_steps(root) if s != step]
            for old_step in others[:max(0, len(others) - (keep - 1))]:
                shutil.rmtree(os.path.join(root, step_dir_name(old_step)), ignore_errors=True)

    try:
        free_at_start = collective_setup(prepare, comm=comm)
        record = collective_setup(write, comm=comm)
        shards = [s for s in comm.allgather(record) if s]   # a few hundred bytes per rank, at save time only
        shards.sort(key=lambda s: s["file"])          # (ep rank, stage, tensor-parallel rank) order
        described, seen = [], set()                   # every stage's tensors, each once, in rank order
        for rank_tensors in comm.allgather([(f"{g}/{p.name}", list(p.global_shape), dtype_name(d.dtype),
                                             p.axis) for g, p, d in mine]):
            described += [t for t in rank_tensors if t[0] not in seen]
            seen.update(t[0] for t in rank_tensors)
        failpoint("save-before-index", step)
        collective_setup(publish, comm=comm)
    except UserError as e:             # on every rank at once, each file closed: remove the partial step
        if comm.Get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.remove(pointer)
        comm.Barrier()                 # gone before save returns anywhere
        raise CheckpointError(str(e), e.status) from e
    return final


def _writes(p, topo) -> bool:
    """Whether this rank writes tensor p: its replica is the first to hold p (dp rank 0 for a dense
    tensor, edp rank 0 for an expert's), and p is a shard or this is tensor-parallel rank 0 (etp's for an
    expert); a shard
    that several tensor-parallel ranks hold (Param.replicas) is written by the first of them."""
    if expert_of(p) is not None:                      # the first of the ranks holding this expert shard
        return topo.edp.rank == 0 and (p.sharded or topo.etp.rank == 0)
    first = topo.dp.rank == 0 and topo.cp.rank == 0
    if p.replicas is not None:
        return first and p.replicas.rank == 0
    return first and (p.sharded or topo.tp.rank == 0)


def _clean_debris(root: str) -> None:
    """Remove what interrupted saves left: `.step-N.tmp` folders (never published) and `step-N.old`
    folders (a re-saved step moved aside); an `.old` whose replacement never arrived is put back."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".step-") and name.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith("step-") and name.endswith(".old"):
            final = path[:-len(".old")]
            if not os.path.exists(final) and os.path.isfile(os.path.join(path, "index.h5")):
                os.rename(path, final)
            else:
                shutil.rmtree(path, ignore_errors=True)
