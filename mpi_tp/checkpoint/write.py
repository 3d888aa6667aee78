"""Sharded HDF5 checkpoints: each rank writes its own shard, an index stitches the full view.

A checkpoint root holds one directory per saved step and a `latest` pointer:

    ROOT/latest                       text: the name of the newest complete step directory
    ROOT/step-00000020/
        shard-00-of-02.h5             tensor-parallel rank 0's slices (+ the replicated tensors)
        shard-01-of-02.h5             rank 1's slices
        index.h5                      format version, configs, layout, step, random state,
                                      and every full tensor as an HDF5 virtual dataset

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
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import h5py
import numpy

from . import backend
from .faults import failpoint
from .runtime import collective_setup

FORMAT = "mpi_tp-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit; the message names the file and the fix."""


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def shard_name(rank: int, size: int) -> str:
    return f"shard-{rank:02d}-of-{size:02d}.h5"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _state_tensors(model, optimizer):
    """(group, Param, array) for every tensor saved: model/<name>, optim/<kind>/<name>."""
    out = [("model", p, p.data) for p in model.parameters()]
    if optimizer is not None:
        for kind, arrays in optimizer.state_tensors().items():
            out += [(f"optim/{kind}", p, a) for p, a in zip(optimizer.params, arrays)]
    return out


# ---------------------------------------------------------------- saving

def _write_shard(path, tensors, tp_rank, step):
    """This rank's slices of the sharded tensors (and, on rank 0, the replicated ones)."""
    pieces = {}
    with h5py.File(path, "w") as f:
        for i, (group, p, data) in enumerate(tensors):
            if not p.sharded and tp_rank != 0:
                continue
            name = f"{group}/{p.name}"
            ds = f.create_dataset(name, data=backend.asnumpy(data), fletcher32=True)
            ds.attrs["global_shape"] = p.global_shape
            ds.attrs["axis"] = -1 if p.axis is None else p.axis
            ds.attrs["start"], ds.attrs["stop"] = p.start, p.stop
            pieces[name] = [p.start, p.stop]
            if i == len(tensors) // 2:
                failpoint("save-during-shards", step)
    _fsync_path(path)
    return pieces


def _write_index(path, shards, tensors, meta):
    """The index: metadata, the layout table, and a virtual dataset per full tensor."""
    layout = {"shards": shards, "tensors": {}}
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = VERSION
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value)
        for group, p, data in tensors:
            name = f"{group}/{p.name}"
            owners = [(r, s["pieces"][name]) for r, s in enumerate(shards) if name in s["pieces"]]
            dtype = numpy.dtype(data.dtype)
            layout["tensors"][name] = {"shape": list(p.global_shape), "dtype": dtype.str,
                                       "axis": p.axis, "pieces": [[r, a, b] for r, (a, b) in owners]}
            vds = h5py.VirtualLayout(shape=p.global_shape, dtype=dtype)
            for r, (a, b) in owners:
                shape = list(p.global_shape)
                idx = [slice(None)] * len(shape)
                if p.axis is not None:
                    shape[p.axis] = b - a
                    idx[p.axis] = slice(a, b)
                vds[tuple(idx)] = h5py.VirtualSource("./" + shards[r]["file"], name, shape=tuple(shape))
            f.create_virtual_dataset(name, vds, fillvalue=numpy.nan if dtype.kind == "f" else 0)
        f.create_dataset("meta/layout", data=json.dumps(layout))
    _fsync_path(path)


def save(root: str, step: int, model, optimizer=None, meta: dict | None = None, keep: int = 0) -> str:
    """Save model (and optimizer) state as ROOT/step-N; collective over every rank of the model's topology.

    The first data-parallel replica's tensor-parallel ranks write the shards (the
    other replicas hold the same numbers); every rank takes part in the agreements,
    so an error anywhere stops all of them together.

    meta: JSON-able entries stored as index attributes (config, train_config, rng, data ...).
    keep: keep only the newest `keep` complete steps (0 = keep all). Returns the step directory.
    """
    group = model.topo.tp
    comm = model.topo.world
    writer = model.topo.dp.rank == 0
    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, "." + step_dir_name(step) + ".tmp")

    def prepare():
        if comm.Get_rank() == 0:
            os.makedirs(root, exist_ok=True)
            _clean_debris(root)
            os.makedirs(tmp)
    collective_setup(prepare, comm=comm)

    tensors = _state_tensors(model, optimizer)
    fname = shard_name(group.rank, group.size)

    def write():
        if not writer:
            return None
        path = os.path.join(tmp, fname)
        pieces = _write_shard(path, tensors, group.rank, step)
        return {"file": fname, "bytes": os.path.getsize(path), "sha256": _sha256(path), "pieces": pieces}
    mine = collective_setup(write, comm=comm)
    shards = [s for s in comm.allgather(mine) if s]   # a few hundred bytes per rank, at save time only
    shards.sort(key=lambda s: s["file"])              # tensor-parallel rank order
    failpoint("save-before-index", step)

    def publish():
        if comm.Get_rank() != 0:
            return
        info = dict(meta or {})
        info.update(step=step, layout=model.topo.describe(), dtypes=str(model.dtype))
        _write_index(os.path.join(tmp, "index.h5"), shards, tensors, info)
        _fsync_path(tmp)
        failpoint("save-before-rename", step)
        if os.path.exists(final):           # re-saving a step: move the old copy aside first
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_path(root)
        failpoint("save-before-latest", step)
        pointer = os.path.join(root, "latest.tmp")
        with open(pointer, "w") as f:
            f.write(step_dir_name(step) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(root, "latest"))
        _fsync_path(root)
        if keep > 0:   # the step just written always stays, with the keep - 1 highest others
            others = [s for s in complete_steps(root) if s != step]
            for old_step in others[:max(0, len(others) - (keep - 1))]:
                shutil.rmtree(os.path.join(root, step_dir_name(old_step)), ignore_errors=True)
    collective_setup(publish, comm=comm)
    return final


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


# ---------------------------------------------------------------- finding and opening

def complete_steps(root: str) -> list[int]:
    """Steps under root whose directory is complete (renamed into place, index present), oldest first."""
    steps = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith("step-") and name[5:].isdigit() and \
                    os.path.isfile(os.path.join(root, name, "index.h5")):
                steps.append(int(name[5:]))
    return sorted(steps)


def resolve(path: str) -> str:
    """A step directory from a step directory, a checkpoint root (its latest), or an index.h5 path."""
    if os.path.basename(path) == "index.h5":
        path = os.path.dirname(path)
    if os.path.isfile(os.path.join(path, "index.h5")):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} not found: pass a checkpoint folder "
                              "(e.g. runs/X/checkpoints) or one of its step-N folders")
    pointer = os.path.join(path, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            named = os.path.join(path, f.read().strip())
        if os.path.isfile(os.path.join(named, "index.h5")):
            return named
    steps = complete_steps(path)       # no pointer, or it names a step being replaced: newest complete
    if not steps:
        raise CheckpointError(f"no complete checkpoint under {path!r} (no step-N folder with an index.h5)")
    return os.path.join(path, step_dir_name(steps[-1]))


class Checkpoint:
    """A complete step directory, opened and checked (cheap checks; `verify` reads everything)."""

    def __init__(self, path: str):
        self.dir = resolve(path)
        self.index_path = os.path.join(self.dir, "index.h5")
        try:
            with h5py.File(self.index_path, "r") as f:
                fmt, version = f.attrs.get("format"), f.attrs.get("format_version")
                if fmt != FORMAT:
                    raise CheckpointError(f"{self.index_path} is not an mpi_tp checkpoint index "
                                          f"(format attribute {fmt!r})")
                if int(version) != VERSION:
                    raise CheckpointError(f"{self.index_path} has format version {int(version)}, but this "
                                          f"mpi_tp reads version {VERSION}: use the mpi_tp release that wrote "
                                          "it, or convert it with that release's `mpi-tp export`")
                self.meta = {k: json.loads(v) for k, v in f.attrs.items() if k not in ("format", "format_version")}
                self.layout = json.loads(f["meta/layout"][()])
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"cannot read checkpoint index {self.index_path} ({e}); it is damaged: "
                                  "load an earlier step-N folder") from None
        self._files = {}                    # shard index -> open h5py.File, opened on first read
        self.step = int(self.meta["step"])
        self.shards = self.layout["shards"]
        self.tensors = self.layout["tensors"]
        self._check_shards_present()

    def _check_shards_present(self):
        """A missing virtual-dataset source reads as fill values without error: check explicitly."""
        for s in self.shards:
            path = os.path.join(self.dir, s["file"])
            if not os.path.isfile(path):
                raise CheckpointError(f"shard {path} is missing (the index lists it): the checkpoint is "
                                      "incomplete; load an earlier step-N folder")
            size = os.path.getsize(path)
            if size != s["bytes"]:
                raise CheckpointError(f"shard {path} has {size} bytes but the index recorded {s['bytes']}: "
                                      "it was truncated or replaced; load an earlier step-N folder")

    def read(self, name: str, axis=None, start: int = 0, stop: int | None = None):
        """Full tensor `name`, or its slice [start, stop) along the axis it is split on, from the shards.

        Only the overlapping part of each shard is read (an HDF5 hyperslab), so a rank
        loading its slice at any tensor-parallel size reads no more than it keeps.
        """
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.index_path} has no tensor {name!r}: it was saved from a "
                                  "different model or optimizer")
        shape, split = list(t["shape"]), t["axis"]
        if split is None:                                   # replicated: one whole copy, in one shard
            return self._read_piece(t["pieces"][0][0], name, ())
        if axis is not None and axis != split:
            raise CheckpointError(f"{name}: saved split along axis {split}, requested along {axis}")
        if axis is None:
            start, stop = 0, shape[split]
        shape[split] = stop - start
        out = numpy.empty(shape, dtype=numpy.dtype(t["dtype"]))
        covered = 0
        for r, a, b in t["pieces"]:
            lo, hi = max(a, start), min(b, stop)
            if lo >= hi:
                continue
            src = [slice(None)] * len(shape)
            dst = [slice(None)] * len(shape)
            src[split], dst[split] = slice(lo - a, hi - a), slice(lo - start, hi - start)
            out[tuple(dst)] = self._read_piece(r, name, tuple(src))
            covered += hi - lo
        if covered != stop - start:
            raise CheckpointError(f"{self.index_path}: the shards of {name!r} do not cover [{start}, {stop}) "
                                  "of its split axis: the index is inconsistent")
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _read_piece(self, r, name, src):
        path = os.path.join(self.dir, self.shards[r]["file"])
        try:
            if r not in self._files:
                self._files[r] = h5py.File(path, "r")
            return self._files[r][name][src]
        except (OSError, KeyError) as e:
            raise CheckpointError(f"cannot read {name!r} from shard {path} ({e}): the file is damaged "
                                  "(checksum or structure); load an earlier step-N folder") from None

    def verify(self) -> list[str]:
        """Full check: every shard's SHA-256 and every dataset's checksum. Returns the problems found."""
        problems = []
        for s in self.shards:
            path = os.path.join(self.dir, s["file"])
            if _sha256(path) != s["sha256"]:
                problems.append(f"{path}: SHA-256 differs from the index (bytes changed since saving)")
        for name, t in self.tensors.items():
            try:
                self.read(name)
            except CheckpointError as e:
                problems.append(str(e))
        return problems


# ---------------------------------------------------------------- loading into a model

def check_model_config(ckpt: Checkpoint, cfg) -> None:
    """Refuse to load into a model whose architecture differs from the saved one."""
    saved = ckpt.meta.get("config", {})
    diff = [f"{k}: checkpoint {saved[k]} vs model {v}" for k, v in cfg.to_dict().items()
            if k in saved and k != "dropout" and saved[k] != v]
    if diff:
        raise CheckpointError(f"checkpoint {ckpt.dir} was saved from a different model ({'; '.join(diff)}): "
                              "build the model with the checkpoint's configuration (drop the conflicting "
                              "options) or start a new run")


def rng_state(model) -> dict:
    """The random state a resume needs: dropout masks are keyed by (seed, step), nothing else is drawn."""
    return {"dropout_seed": model.dropout.seed, "dropout_step": model.dropout.step}


def restore_rng(ckpt: Checkpoint, model) -> None:
    rng = ckpt.meta.get("rng", {})
    model.dropout.seed = int(rng.get("dropout_seed", model.dropout.seed))
    model.dropout.step = int(rng.get("dropout_step", ckpt.step))


def load_into(ckpt: Checkpoint, model, optimizer=None) -> None:
    """Fill this rank's shards (and the optimizer's) from the checkpoint, whatever layout saved it."""
    check_model_config(ckpt, model.cfg)

    def read(group, p, like):
        values = ckpt.read(f"{group}/{p.name}", p.axis, p.start, p.stop)
        if values.shape != like.shape:
            raise CheckpointError(f"{group}/{p.name}: checkpoint slice {values.shape} does not fit the "
                                  f"model's {like.shape}")
        return backend.asarray(values.astype(like.dtype, copy=False))
    for p in model.parameters():
        p.data[...] = read("model", p, p.data)
    if optimizer is not None:
        kinds = optimizer.state.keys()
        optimizer.load_state_tensors({k: [read(f"optim/{k}", p, p.data) for p in optimizer.params] for k in kinds})
        optimizer.t = int(ckpt.meta.get("optimizer_t", 0))
