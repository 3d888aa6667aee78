"""What `mpi-tp compare` reads and compares: the two inputs (find), their loss curves (curves, compare_curves),
their models' configurations (same_model) and their tensors by name (compare_tensors).

An input is a run folder (train --out: metrics.jsonl, run.json, checkpoints/), a checkpoint root (its latest
step), one step-N folder, or a Hugging Face folder (mpi_tp.checkpoint.hf: its weights, step 0).
"""
from __future__ import annotations

import dataclasses
import json
import os

import ml_dtypes
import numpy

from mpi_tp.checkpoint.format import complete_steps, step_dir_name
from mpi_tp.checkpoint.read import TRAINING_ONLY, open_checkpoint
from mpi_tp.core.errors import UserError
from mpi_tp.model.config import GPTConfig


@dataclasses.dataclass
class Source:
    label: str                   # "A" or "B"
    path: str                    # as given
    kind: str                    # "run folder", "checkpoint folder", "step folder", "Hugging Face folder"
    checkpoint: str | None       # the step folder (or Hugging Face folder) whose tensors are compared
    metrics: str | None          # metrics.jsonl, when it has a loss curve
    run: dict | None             # run.json, when there is one

    def describe(self) -> str:
        if self.checkpoint is None or self.kind == "Hugging Face folder":
            return f"{self.path} ({self.kind}{'; no checkpoint' if self.checkpoint is None else ''})"
        return f"{self.path} ({self.kind}; checkpoint step {int(os.path.basename(self.checkpoint)[5:])})"


def _checkpoint_in(root: str, step: int | None, label: str, path: str) -> str:
    """The step folder under a checkpoint root: step's, or the latest."""
    steps = complete_steps(root)
    if step is None:
        from mpi_tp.checkpoint.read import resolve
        return resolve(root)
    if step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise UserError(f"compare: {label} ({path}) has no checkpoint at step {step} (its steps: {have}): "
                        f"pass one of those to --step-{label.lower()}")
    return os.path.join(root, step_dir_name(step))


def find(path: str, step: int | None, label: str) -> Source:
    """The input at `path`, or one UserError saying what it should have been."""
    from mpi_tp.checkpoint.hf import is_hf_folder
    if not os.path.isdir(path):
        raise UserError(f"compare: {label} = {path} is not a folder: give a run folder (train --out), its "
                        "checkpoints/ folder, one step-N folder or a Hugging Face folder")
    metrics, run_json, root = (os.path.join(path, n) for n in ("metrics.jsonl", "run.json", "checkpoints"))
    if os.path.isfile(metrics) or os.path.isfile(run_json):
        run = None
        if os.path.isfile(run_json):
            with open(run_json) as f:
                run = json.load(f)
        ck = _checkpoint_in(root, step, label, path) if complete_steps(root) or step is not None else None
        return Source(label, path, "run folder", ck, metrics if os.path.isfile(metrics) else None, run)
    if os.path.isfile(os.path.join(path, "index.h5")):
        if step is not None:
            return Source(label, path, "step folder", _checkpoint_in(os.path.dirname(os.path.abspath(path)),
                                                                     step, label, path), None, None)
        return Source(label, path, "step folder", path, None, None)
    if complete_steps(path):
        return Source(label, path, "checkpoint folder", _checkpoint_in(path, step, label, path), None, None)
    if is_hf_folder(path):
        if step is not None:
            raise UserError(f"compare: {label} ({path}) is a Hugging Face folder, which has no steps: drop "
                            f"--step-{label.lower()}")
        return Source(label, path, "Hugging Face folder", path, None, None)
    raise UserError(f"compare: {label} = {path} is none of a run folder (metrics.jsonl, checkpoints/), a "
                    "checkpoint folder (step-N folders), a step-N folder (index.h5) or a Hugging Face folder "
                    "(config.json, safetensors)")


# ---------------------------------------------------------------- loss curves

def curves(metrics: str) -> dict[str, dict[int, float]]:
    """{"loss": {step: training loss}, "val_loss": {step: validation loss}} of a metrics.jsonl (a step logged
    twice, as by a resumed run: its last line)."""
    out = {"loss": {}, "val_loss": {}}
    with open(metrics) as f:
        for i, line in enumerate(f, 1):
            try:
                m = json.loads(line)
            except ValueError:
                raise UserError(f"compare: {metrics} line {i} is not JSON (a run killed while writing it?): "
                                "remove that line") from None
            for key, series in out.items():
                if key in m and "skipped" not in m:
                    series[int(m["step"])] = float(m[key])
    return out


def compare_curves(a: dict[int, float], b: dict[int, float], rows: int = 20) -> dict:
    """The shared steps of two curves: each one's difference (at most `rows` rows shown: every k-th step,
    the last and the worst), the largest absolute and relative (to A) difference and where."""
    steps = sorted(set(a) & set(b))
    diff = {s: b[s] - a[s] for s in steps}
    rel = {s: abs(diff[s]) / abs(a[s]) if a[s] else abs(diff[s]) for s in steps}
    worst = max(steps, key=lambda s: abs(diff[s]))
    worst_rel = max(steps, key=lambda s: rel[s])
    k = -(-len(steps) // rows)
    shown = sorted(set(steps[::k]) | {steps[-1], worst, worst_rel})
    return {"steps": len(steps), "first": steps[0], "last": steps[-1], "every": k,
            "max_abs": abs(diff[worst]), "max_abs_step": worst, "max_rel": rel[worst_rel], "max_rel_step": worst_rel,
            "rows": [{"step": s, "a": a[s], "b": b[s], "diff": diff[s]} for s in shown],
            "a": [[s, v] for s, v in sorted(a.items())], "b": [[s, v] for s, v in sorted(b.items())]}


# ---------------------------------------------------------------- the models

def _config(src: Source) -> dict | None:
    """The model's configuration, resolved (None fields as what they stand for): from its checkpoint, else
    the run's run.json."""
    if src.checkpoint:
        ck = open_checkpoint(src.checkpoint)
        try:
            saved = ck.meta["config"]
        finally:
            ck.close()
    elif src.run:
        saved = src.run.get("model", {})
    else:
        return None
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in saved.items() if k in names}).resolved().to_dict()


def same_model(a: Source, b: Source) -> dict | None:
    """A's model configuration if B's is the same (training-only options aside); one UserError naming the
    first field that differs otherwise."""
    ca, cb = _config(a), _config(b)
    if ca is None or cb is None:
        return ca or cb
    for key, value in ca.items():
        if key not in TRAINING_ONLY and cb.get(key) != value:
            raise UserError(f"compare: A and B are different models: {key} = {value} in A ({a.path}), "
                            f"{cb.get(key)} in B ({b.path}); compare runs of the same model")
    return ca


def tensor_names(ck) -> list[str]:
    """Every tensor an open checkpoint holds (a Hugging Face folder: its model/ tensors)."""
    if hasattr(ck, "tensors"):
        return list(ck.tensors)
    return [f"model/{name}" for name in ck.pieces]


def _group(name: str) -> str:
    """model/... -> "model", optim/m/... -> "optim/m": tensors of one scale."""
    return "/".join(name.split("/")[:2]) if name.startswith("optim/") else "model"


def compare_tensors(a: Source, b: Source, optim: bool) -> dict:
    """Every tensor by name (model/, and optim/ with optim): max |A - B|, and that relative to the tensor's
    largest magnitude (in A or B), sorted worst (relative) first; names only in one.

    The relative scale is at least sqrt(eps) of the largest magnitude of its group (the model's parameters,
    or one optimizer moment), eps of the narrower of the two tensors' formats: a tensor that is zero to
    rounding in both (a key bias, whose gradient is zero: softmax ignores it) does not read as 100% apart."""
    cka, ckb = open_checkpoint(a.checkpoint), open_checkpoint(b.checkpoint)
    try:
        keep = ("model/", "optim/") if optim else ("model/",)
        na = [n for n in tensor_names(cka) if n.startswith(keep)]
        nb = [n for n in tensor_names(ckb) if n.startswith(keep)]
        rows, in_a, in_b, top = [], set(na), set(nb), {}
        for name in (n for n in na if n in in_b):
            x, y = numpy.asarray(cka.read(name)), numpy.asarray(ckb.read(name))
            eps = max(float(ml_dtypes.finfo(x.dtype).eps), float(ml_dtypes.finfo(y.dtype).eps))
            x, y = x.astype(numpy.float64), y.astype(numpy.float64)
            if x.shape != y.shape:
                rows.append({"name": name, "shape_a": list(x.shape), "shape_b": list(y.shape),
                             "max_abs": float("inf"), "max_rel": float("inf")})
                continue
            scale = max(float(numpy.abs(x).max()), float(numpy.abs(y).max())) if x.size else 0.0
            top[_group(name)] = max(top.get(_group(name), 0.0), scale)
            rows.append({"name": name, "shape": list(x.shape), "scale": scale, "eps": eps,
                         "max_abs": float(numpy.abs(x - y).max()) if x.size else 0.0})
        for r in rows:
            if "scale" in r:
                floor = numpy.sqrt(r.pop("eps")) * top[_group(r["name"])]
                scale = max(r.pop("scale"), floor)
                r["max_rel"] = r["max_abs"] / scale if scale else r["max_abs"]
        rows.sort(key=lambda r: (-r["max_rel"], -r["max_abs"], r["name"]))
        return {"step_a": cka.step, "step_b": ckb.step, "compared": len(rows),
                "only_a": [n for n in na if n not in in_b], "only_b": [n for n in nb if n not in in_a],
                "tensors": rows}
    finally:
        cka.close()
        ckb.close()
