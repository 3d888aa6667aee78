"""Reading checkpoints: find the newest complete step, check it, and load any slice at any layout."""
from __future__ import annotations

import json
import os

import h5py
import numpy

from mpi_tp.checkpoint.format import (
    FORMAT,
    VERSION,
    CheckpointError,
    as_saved,
    complete_steps,
    sha256_file,
    step_dir_name,
    stored_dtype,
)
from mpi_tp.core import backend
from mpi_tp.parallel.fsdp import whole_params


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


def open_checkpoint(path: str):
    """What a command loading a model was given: a Hugging Face model folder (config.json and safetensors:
    mpi_tp.checkpoint.hf.HFFolder) or an mpi_tp checkpoint (Checkpoint). Both have dir, step, meta
    ("config", "dtypes"), has_optimizer and read(name, axis, start, stop), so load_into takes either."""
    from mpi_tp.checkpoint.hf import HFFolder, is_hf_folder
    return HFFolder(path) if is_hf_folder(path) else Checkpoint(path)


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

    def tokenizer(self):
        """What the model reads text with (mpi_tp.text.tokenizer): the tokenizer.json saved with it, or bytes."""
        from mpi_tp.text.tokenizer import from_record
        text = None
        if self.meta.get("tokenizer", {}).get("kind", "bytes") != "bytes":
            with h5py.File(self.index_path, "r") as f:
                if "meta/tokenizer.json" in f:
                    text = f["meta/tokenizer.json"][()].tobytes().decode()
        return from_record(self.meta.get("tokenizer"), text, f"checkpoint {self.dir}")

    @property
    def has_optimizer(self) -> bool:
        """Whether the optimizer's state was saved with the model (a training save; not an import)."""
        return any(name.startswith("optim/") for name in self.tensors)

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
            return as_saved(self._read_piece(t["pieces"][0][0], name, ()), t["dtype"])
        if axis is not None and axis != split:
            raise CheckpointError(f"{name}: saved split along axis {split}, requested along {axis}")
        if axis is None:
            start, stop = 0, shape[split]
        shape[split] = stop - start
        out = numpy.empty(shape, dtype=stored_dtype(t["dtype"]))        # bfloat16: its uint16 words
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
        return as_saved(out, t["dtype"])

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
            if sha256_file(path) != s["sha256"]:
                problems.append(f"{path}: SHA-256 differs from the index (bytes changed since saving)")
        for name, t in self.tensors.items():
            try:
                self.read(name)
            except CheckpointError as e:
                problems.append(str(e))
        return problems


# ---------------------------------------------------------------- loading into a model

# How a model is trained, not what it is: these may differ between a checkpoint and the model loading it.
TRAINING_ONLY = ("dropout", "moe_capacity", "moe_aux_weight", "moe_z_weight", "moe_drop_policy",
                 "moe_bias_rate", "moe_dispatcher")


def check_model_config(ckpt: Checkpoint, cfg) -> None:
    """Refuse to load into a model whose architecture differs from the saved one.

    A key the saved configuration lacks (written before the field existed, e.g. moe_* in a
    checkpoint older than mixture of experts, arch in one older than Llama) counts as the
    field's default, which is what that model was; so a dense checkpoint and a
    mixture-of-experts model (or the reverse) differ in moe_experts. Fields left None compare
    as what they stand for (n_kv_head None is n_head). Routing options (moe_top_k, moe_every) count only for MoE models."""
    defaults = type(cfg)().to_dict()
    saved = {**defaults, **ckpt.meta.get("config", {})}
    mine = cfg.to_dict()
    if hasattr(cfg, "resolved"):     # a None (n_kv_head, intermediate_size, ...) stands for its arch's default
        saved = type(cfg)(**{k: v for k, v in saved.items() if k in defaults}).resolved().to_dict()
        mine = cfg.resolved().to_dict()
    dense = not saved.get("moe_experts") and not mine.get("moe_experts")
    diff = [f"{k}: checkpoint {saved[k]} vs model {v}" for k, v in mine.items()
            if k in saved and k not in TRAINING_ONLY and saved[k] != v and not (dense and k.startswith("moe_"))]
    if diff:
        kinds = ""
        if bool(saved.get("moe_experts")) != bool(mine.get("moe_experts")):
            kinds = (f"a {'mixture-of-experts' if saved.get('moe_experts') else 'dense'} checkpoint into a "
                     f"{'mixture-of-experts' if mine.get('moe_experts') else 'dense'} model; ")
        raise CheckpointError(f"checkpoint {ckpt.dir} was saved from a different model ({kinds}{'; '.join(diff)}): "
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

    def read(group, p, shape, dtype):
        values = ckpt.read(f"{group}/{p.name}", p.axis, p.start, p.stop)
        if values.shape != shape:
            raise CheckpointError(f"{group}/{p.name}: checkpoint slice {values.shape} does not fit the "
                                  f"model's {shape}")
        return backend.asarray(values.astype(dtype, copy=False))
    with whole_params(model):          # ZeRO-3: whole while read; each rank keeps its share after
        for p in model.parameters():
            p.data[...] = read("model", p, p.data.shape, p.data.dtype)
        for b in model.buffers():          # a checkpoint older than a buffer has none: it stays as built (zeros)
            if f"model/{b.name}" in getattr(ckpt, "tensors", ()):
                b.data[...] = read("model", b, b.data.shape, b.data.dtype)
        if optimizer is None:
            return
        # each kind in its own dtype (fp32 masters and moments of 16-bit params); without the optimizer's state
        # (an import, a Hugging Face folder) the moments stay fresh, and without masters (that, or a checkpoint of
        # a wider run) a 16-bit model's masters are the checkpoint's weights read in fp32: exactly an fp32 run's
        saved = ckpt.has_optimizer
        masters_saved = saved and f"optim/master/{optimizer.params[0].name}" in getattr(ckpt, "tensors", ())
        values = {}
        for kind, arrays in optimizer.state.items():
            dtype = arrays[0].dtype if arrays else None
            group = f"optim/{kind}" if kind != "master" or masters_saved else "model"
            if saved or kind == "master":
                values[kind] = [read(group, p, p.data.shape, dtype or p.data.dtype) for p in optimizer.params]
            else:
                values[kind] = [backend.xp().zeros(p.data.shape, dtype or p.data.dtype) for p in optimizer.params]
        optimizer.load_state_tensors(values)
        optimizer.t = int(ckpt.meta.get("optimizer_t", 0)) if saved else 0
