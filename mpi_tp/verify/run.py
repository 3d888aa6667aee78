"""The verification: K steps of a layout beside the serial model, compared after each, stopped at the first
difference, which is named.

Each step runs the library's own step on both (training.loop.run_step for the layout, the reference on the
whole global batch), then compares, on every rank: the loss, the gradient norm, every gradient the update
read and every parameter after it (shards.py). At the first step where one differs by more than the
tolerance, the layers' outputs recorded during that step (activations.py) say where the forward pass first
went wrong (or that it did not: then a backward pass or a gradient's reduction did), and the parameters'
gradients, taken in the order the backward pass computes them (the last block first), say which tensor
first came out wrong, on which rank, in which slice of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy
from mpi4py import MPI

from mpi_tp.parallel.fsdp import whole_params
from mpi_tp.parallel.pipeline.stage import PipelineStage
from mpi_tp.training import loop
from mpi_tp.training.optim import lr_at
from mpi_tp.verify.activations import Recorder, layer_errors, layer_names
from mpi_tp.verify.reference import reference
from mpi_tp.verify.shards import gradient_differences, parameter_differences


@dataclass
class StepResult:
    step: int
    loss: float
    loss_error: float
    norm_error: float
    grad: tuple                   # (name, error, where, shard, rank) of the largest gradient difference
    param: tuple                  # ... and of the largest parameter difference
    ok: bool
    first: dict = field(default_factory=dict)     # the first difference, named (when not ok)


def _chunks(model) -> list:
    return model.chunks if isinstance(model, PipelineStage) else [model]


BLOCK_BACKWARD = ("mlp/proj", "mlp/down", "mlp/fc", "mlp/up", "mlp/gate", "moe/", "ln_2", "attn/proj", "attn/q",
                  "attn/k", "attn/v", "ln_1")     # a block's parameters, in the order its backward reaches them


def _backward_order(names: list[str], n_layer: int) -> list[str]:
    """Parameter names in the order the backward pass completes them: the head and final norm, then the
    blocks from the last to the first (each from its MLP back to its first norm), then the embeddings."""
    def key(name):
        if name.startswith("h/"):
            _, i, rest = name.split("/", 2)
            within = next((k for k, part in enumerate(BLOCK_BACKWARD) if rest.startswith(part)), len(BLOCK_BACKWARD))
            return 1 + (n_layer - 1 - int(i)), within
        return (0, 0) if name.startswith(("ln_f", "lm_head")) else (n_layer + 1, 0)
    return sorted(names, key=key)


def _gathered(rows: list[tuple], comm) -> list[tuple]:
    """Every rank's (name, error, where, shard) rows, with the rank, on every rank (small host data)."""
    return [row + (r,) for r, part in enumerate(comm.allgather(rows)) for row in part]


def _worst(rows: list[tuple]) -> tuple:
    return max(rows, key=lambda r: r[1]) if rows else ("-", 0.0, (), "", 0)


def verify_steps(run, steps: int, tol: float, say=print) -> list[StepResult]:
    """Run `steps` steps of `run` (a training.build.Run) beside its serial reference; stop at the first that
    differs. `say` prints a step's line (rank 0)."""
    comm, cfg = run.comm, run.cfg
    ref = reference(run)
    layers = layer_names(run.model.cfg.n_layer)
    mine, theirs = Recorder(_chunks(run.model)), Recorder([ref.model])
    serial = ref.params
    results = []
    try:
        for step in range(run.first, run.first + steps):
            mine.clear(), theirs.clear()
            lr = lr_at(step - 1, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
            loss, norm, problem = loop.run_step(run, step, lr)
            x, y = run.sampler.batch(step - 1)
            ref_loss, ref_norm = ref.step(x, y, lr, cfg.grad_clip)
            grads = _gathered([d.as_row() for d in gradient_differences(run.opt, serial)], comm)
            with whole_params(run.model):            # ZeRO-3: gathered for the comparison
                params = parameter_differences(run.model.parameters(), serial)
            params = _gathered([d.as_row() for d in params], comm)
            loss_error = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
            norm_error = abs(norm - ref_norm) / max(abs(ref_norm), 1e-30)
            ok = problem is None and max([loss_error, norm_error] + [r[1] for r in grads + params]) <= tol
            result = StepResult(step, loss, loss_error, norm_error, _worst(grads), _worst(params), ok)
            if not ok:
                here = layer_errors(mine, theirs, layers)
                errors = numpy.empty_like(here)
                comm.Allreduce(here, errors, op=MPI.MAX)          # each layer ran on some ranks only (pp)
                result.first = first_difference(grads, params, errors, layers, tol, run.model.cfg.n_layer, problem)
            results.append(result)
            say(step_line(result))
            if not ok:
                break
    finally:
        ref.free()
    return results


def first_difference(grads, params, errors, layers, tol, n_layer, problem) -> dict:
    """What to name at the first step that differs: the first layer whose output differs (or None), the
    first gradient in backward order that differs and where, the largest parameter difference."""
    bad = [layers[k] for k, e in enumerate(errors) if e > tol]
    by_name = {}
    for row in grads:
        if row[1] > tol and (row[0] not in by_name or row[1] > by_name[row[0]][1]):
            by_name[row[0]] = row
    order = _backward_order(list(by_name), n_layer)
    over = [r for r in params if r[1] > tol]
    return {"layer": bad[0] if bad else None,
            "layer_error": float(errors[layers.index(bad[0])]) if bad else 0.0,
            "gradient": by_name[order[0]] if order else None,
            "gradients_differing": len(by_name),
            "parameter": _worst(over) if over else None,
            "problem": problem}


def step_line(r: StepResult) -> str:
    g, p = r.grad, r.param
    return (f"{r.step:>5}  {r.loss:12.8f}  {r.loss_error:9.1e}  {r.norm_error:9.1e}  {g[1]:9.1e} {g[0]:<24}"
            f"  {p[1]:9.1e} {p[0]:<24}  {'ok' if r.ok else 'DIFFERS'}")


HEADER = (f"{'step':>5}  {'loss':>12}  {'loss err':>9}  {'norm err':>9}  {'gradient (largest error, tensor)':<34}"
          f"  {'parameter after the update':<34}  verdict")


def verdict(results: list[StepResult], tol: float) -> str:
    """The closing lines: all agree, or the first difference named."""
    last = results[-1]
    if last.ok:
        return (f"every step agrees with the serial model within {tol:.0e} (loss, gradient norm, every gradient "
                f"and every parameter, by name): {len(results)} step{'s' * (len(results) > 1)}")
    f = last.first
    lines = [f"first difference at step {last.step} (tolerance {tol:.0e}):"]
    if f.get("problem"):
        lines.append(f"  the layout's step failed: {f['problem']}")
    if f["layer"] is None:
        lines.append("  forward: every layer's output agrees (the bug is in a backward pass, a gradient's "
                     "reduction or the update)")
    else:
        lines.append(f"  forward: the first layer whose output differs is {f['layer']} "
                     f"(error {f['layer_error']:.1e} of its largest value)")
    g = f["gradient"]
    if g is not None:
        name, err, where, shard, rank = g
        lines.append(f"  backward: the first gradient to differ, in the order the backward pass computes them, is "
                     f"{name} (error {err:.1e} of its scale), element {list(where)} of the whole tensor, in rank "
                     f"{rank}'s shard {shard}; {f['gradients_differing']} tensors' gradients differ")
    p = f["parameter"]
    if p is not None:
        lines.append(f"  update: the largest parameter difference is {p[0]} ({p[1]:.1e}), rank {p[4]}'s shard {p[3]}")
    return "\n".join(lines)
