"""Where a training configuration comes from: the defaults, a --config JSON file, the saved model of
--init-from (a checkpoint or a Hugging Face folder) and the command line, in that order of precedence.

    add_arguments(parser)        one --option per TrainConfig field, plus --config FILE
    cfg = resolve(args, world)   the TrainConfig those give (--resume: the checkpoint's global batch kept)
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, fields

from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.training.config import TrainConfig


def load_json(path: str) -> dict:
    """The keys of a JSON config file, checked against TrainConfig's fields."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found")
    try:
        with open(path) as f:
            values = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"config file {path!r} is not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path!r} must hold a JSON object of option: value")
    known = {f.name: f for f in fields(TrainConfig)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"config file {path!r}: unknown option(s) {', '.join(unknown)}; "
                          f"see mpi-tp train --help")
    for k, v in values.items():
        want = type(known[k].default)
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            values[k] = float(v)
        elif not isinstance(v, want) or isinstance(v, bool) != (want is bool):
            raise ConfigError(f"config file {path!r}: {k} should be {want.__name__}, got {v!r}")
    return values


def add_arguments(parser) -> None:
    """One --option per TrainConfig field (defaults shown in --help), plus --config FILE."""
    parser.add_argument("--config", metavar="FILE.json",
                        help="JSON file of options; options given on the command line win")
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else None
        if isinstance(default, bool):          # --name sets it; --no-name clears a default of True
            flag = f"--{f.name.replace('_', '-')}" if not default else f"--no-{f.name.replace('_', '-')}"
            parser.add_argument(flag, dest=f.name, action="store_const", const=not default, default=None,
                                help=f.metadata["help"])
            continue
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(default),
                            default=None, choices=f.metadata.get("choices"), metavar=None
                            if f.metadata.get("choices") else f.name.upper(),
                            help=f"{f.metadata['help']} (default: {default!r})")


def model_defaults(cfg: GPTConfig) -> dict:
    """The model options of a saved model's configuration (--init-from: the run's defaults)."""
    out = {"vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
           "n_embd": cfg.n_embd, "arch": cfg.arch, "norm_eps": cfg.norm_eps,
           "intermediate_size": cfg.intermediate_size or 0}
    if cfg.llama:
        out.update(n_kv_head=cfg.n_kv_head or 0, rope_theta=cfg.rope_theta, tie_embeddings=cfg.tied,
                   untie_embeddings=not cfg.tied, qkv_bias=cfg.qkv_bias, sliding_window=cfg.sliding_window or 0,
                   rope_scaling=json.dumps(cfg.rope_scaling) if cfg.rope_scaling else "")
    if cfg.moe_experts:
        out.update(moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k, moe_every=cfg.moe_every,
                   moe_capacity=cfg.moe_capacity, moe_router=cfg.moe_router, moe_topk_norm=cfg.moe_topk_norm,
                   moe_gate_scale=cfg.moe_gate_scale, moe_shared_experts=cfg.moe_shared_experts,
                   moe_drop_policy=cfg.moe_drop_policy)
    return out


def batch_split(meta: dict) -> tuple[int, int, int] | None:
    """(D, M, B) a checkpoint's run stepped with, from its metadata: replicas, micro-batches per replica and
    sequences per micro-batch (the global batch is their product); None when it does not say."""
    train, layout = meta.get("train_config", {}), meta.get("layout", {})
    if not {"batch_size", "micro_batches"} <= set(train):
        return None
    return int(layout.get("dp", train.get("dp", 1))), train["micro_batches"], train["batch_size"]


def saved_global_batch(out: str) -> tuple[int, int, str] | None:
    """(step, global batch, its split) of the newest checkpoint in out/checkpoints, or None (no checkpoint,
    or one that does not say)."""
    from mpi_tp.checkpoint import Checkpoint, complete_steps
    root = os.path.join(out, "checkpoints")
    if not out or not complete_steps(root):
        return None
    with Checkpoint(root) as saved:
        split, step = batch_split(saved.meta), saved.step
    if split is None:
        return None
    D, M, B = split
    return step, D * M * B, f"dp {D} x micro-batches {M} x batch-size {B}"


def keep_global_batch(values: dict, world: int) -> dict:
    """Resume anywhere: --resume without --batch-size continues on the checkpoint's global batch (the same
    sequences every step, so the same numbers at any layout), whatever dp and micro-batches this run has;
    the per-replica batch follows. A global batch this layout cannot split evenly is refused in one line."""
    if not values.get("resume") or "batch_size" in values:
        return values
    saved = saved_global_batch(values.get("out", ""))
    if saved is None:
        return values
    step, G, split = saved
    cfg = TrainConfig(**values)
    D, M = cfg.layout(world).dp, cfg.micro_batches
    if G % (D * M):
        raise ConfigError(f"--resume: the checkpoint of step {step} trained on a global batch of {G} sequences "
                          f"({split}), which dp {D} x micro-batches {M} cannot split evenly: choose --dp and "
                          f"--micro-batches whose product divides {G}, or give --batch-size to change the "
                          "global batch")
    return {**values, "batch_size": G // (D * M)}


def resolve(args, world: int | None = None) -> TrainConfig:
    """Defaults, then (--init-from a checkpoint or a Hugging Face folder) its model (model_defaults), then
    the --config file, then the options given on the command line. A model option given that differs from
    the saved model's is refused when the weights load (checkpoint.check_model_config). world (the job's
    size): with --resume and no --batch-size, the batch that keeps the checkpoint's global batch."""
    values = load_json(args.config) if args.config else {}
    for f in fields(TrainConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    init_from = values.get("init_from", "")
    if init_from:
        from mpi_tp.checkpoint import open_checkpoint
        with open_checkpoint(init_from) as saved:
            defaults = model_defaults(GPTConfig(**saved.meta["config"]))
        if {"tie_embeddings", "untie_embeddings"} & set(values):     # one of the pair given: it decides
            defaults = {k: v for k, v in defaults.items() if k not in ("tie_embeddings", "untie_embeddings")}
        if "moe_experts" in values:                                    # given: the experts are the options'
            defaults = {k: v for k, v in defaults.items() if not k.startswith("moe_")}
        values = {**defaults, **values}
    if world is not None:
        values = keep_global_batch(values, world)
    return TrainConfig(**values)
