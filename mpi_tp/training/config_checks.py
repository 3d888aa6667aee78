"""What a run configuration may not be, in CLI terms: TrainConfig.validate's checks, each a ConfigError that
says what to change (the layout's own rules: mpi_tp.parallel.layout; the model's: GPTConfig.validate)."""
from __future__ import annotations

from dataclasses import fields

from mpi_tp.model.config import ConfigError


def _given(cfg, names) -> list[str]:
    """The options among `names` set away from their defaults, as flags (--moe-top-k)."""
    default = {f.name: f.default for f in fields(cfg)}
    return [f"--{n.replace('_', '-')}" for n in names if getattr(cfg, n) != default[n]]


def check(cfg, world_size: int) -> None:
    """The whole check of a TrainConfig for a job of world_size ranks; the first problem raises."""
    for f in fields(cfg):
        choices = f.metadata.get("choices")
        if choices and getattr(cfg, f.name) not in choices:
            raise ConfigError(f"{f.name} = {getattr(cfg, f.name)!r}: choose one of "
                              f"{', '.join(map(str, choices))}")
    for key in ("steps", "batch_size", "micro_batches", "log_every", "eval_every", "eval_batches"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key} must be at least 1, got {getattr(cfg, key)}")
    for key in ("warmup", "sample_len", "save_every", "keep", "vocab_size"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(cfg, key)}")
    if not 0 < cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got {cfg.val_fraction}")
    if cfg.lr <= 0:
        raise ConfigError(f"lr must be positive, got {cfg.lr}")
    if cfg.resume and not cfg.out:
        raise ConfigError("--resume needs --out: the folder of the run to continue")
    if cfg.resume and cfg.init_from:
        raise ConfigError("use either --resume or --init-from, not both")
    if cfg.overwrite and cfg.resume:
        raise ConfigError("use either --resume (continue the run in --out) or --overwrite (move it aside and "
                          "start afresh), not both")
    if cfg.temperature <= 0:
        raise ConfigError(f"temperature must be positive, got {cfg.temperature}")
    if cfg.dp < 1 or cfg.pp < 1 or cfg.tp < 0 or cfg.virtual_stages < 1:
        raise ConfigError(f"dp, pp and virtual_stages must be at least 1 and tp at least 0 (0: world size "
                          f"/ (pp * dp)), got tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} "
                          f"virtual_stages={cfg.virtual_stages}")
    if cfg.zero >= 2 and cfg.dp_allreduce == "hierarchical":
        raise ConfigError(f"--zero {cfg.zero} drops each bucket's gradients after its flat reduce-scatter: use "
                          "--dp-allreduce flat (or --zero 1 with the hierarchical all-reduce)")
    if cfg.schedule == "zb-v" and cfg.virtual_stages != 2:
        raise ConfigError(f"--schedule zb-v places two chunks per stage in a V: use --virtual-stages 2 "
                          f"(got {cfg.virtual_stages})")
    if cfg.virtual_stages > 1 and cfg.schedule not in ("interleaved", "zb-v"):
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} needs --schedule interleaved (or zb-v)")
    if cfg.schedule == "interleaved" and cfg.micro_batches % cfg.pp:
        raise ConfigError(f"the interleaved schedule needs a multiple of the {cfg.pp} pipeline stages as "
                          f"--micro-batches, got {cfg.micro_batches}")
    if cfg.n_layer < cfg.pp * cfg.virtual_stages:
        raise ConfigError(f"{cfg.n_layer} layers cannot fill {cfg.pp} pipeline stages x "
                          f"{cfg.virtual_stages} chunks: every chunk needs a block")
    if cfg.bucket_mb <= 0:
        raise ConfigError(f"bucket_mb must be positive, got {cfg.bucket_mb}")
    _stage_ends(cfg)
    _cp(cfg)
    _moe(cfg)
    _precision(cfg)
    _loss_scale(cfg)
    lay = cfg.layout(world_size)          # the world-size rule and the others: Layout.check
    _arch(cfg)
    cfg.model_config().validate(lay.tp, lay.ep, lay.expert_tp)


def _loss_scale(cfg) -> None:
    names = ("initial_loss_scale", "loss_scale_window", "loss_scale_backoff", "min_loss_scale")
    if cfg.precision != "fp16":
        changed = _given(cfg, names)
        if changed:
            raise ConfigError(f"{', '.join(changed)}: loss scaling is for --precision fp16 (bf16 has fp32's "
                              "exponent range and needs none)")
        return
    try:
        cfg.loss_scaler()
    except ValueError as e:
        raise ConfigError(f"fp16 loss scaling: {e}") from None


def _precision(cfg) -> None:
    """16 bits' reach, in CLI terms: every layout (tp, sp, cp, pp, dp, ZeRO-1, ep); bf16 on NumPy, fp16
    on NumPy and CuPy; what they do not run with is one line each (a float64 checkpoint: build)."""
    if cfg.precision == "fp32":
        if cfg.fp32_grads:
            raise ConfigError("--fp32-grads is for --precision bf16 or fp16 (fp32 gradients are fp32 already)")
        return
    if cfg.dtype != "float32":
        raise ConfigError(f"--precision {cfg.precision} with --dtype {cfg.dtype}: 16-bit training keeps fp32 "
                          "masters (leave --dtype float32), or train in float64 with --precision fp32")
    if cfg.precision == "bf16" and cfg.backend != "numpy":   # emulated, it would save no byte
        raise ConfigError("--precision bf16 runs on --backend numpy only: CuPy has no bfloat16 dtype "
                          "(cupy/cupy#7527) and mpi_tp does not emulate it; use --precision fp16 (CuPy's "
                          "float16) or fp32 on CuPy")


def _stage_ends(cfg) -> None:
    """--first-stage-layers / --last-stage-layers, in CLI terms (the rule itself: pipeline.stages.stage_blocks)."""
    first, last, L, P, v = cfg.first_stage_layers, cfg.last_stage_layers, cfg.n_layer, cfg.pp, cfg.virtual_stages
    if first < 0 or last < 0:
        raise ConfigError(f"--first-stage-layers and --last-stage-layers must be >= 0 (0: an even share), got "
                          f"{first} and {last}")
    given = [f"--{n}-stage-layers {k}" for n, k in (("first", first), ("last", last)) if k]
    if not given:
        return
    if P < 2:
        raise ConfigError(f"{' and '.join(given)}: the blocks of a pipeline's end stages need --pp 2 or more "
                          f"(got --pp {P}); drop them or pipeline the model")
    for flag, k in (("--first-stage-layers", first), ("--last-stage-layers", last)):
        if 0 < k < v:
            raise ConfigError(f"{flag} {k}: that stage's {v} chunks (--virtual-stages {v}) need a block each; "
                              f"give it at least {v}")
    if first + last > L:
        raise ConfigError(f"{' and '.join(given)} add up to {first + last} blocks, more than --n-layer {L}")
    others = P - 2 + (not first) + (not last)                 # the stages that share what the ends leave
    if others == 0 and first + last != L:
        raise ConfigError(f"--pp 2 with {' and '.join(given)}: the two stages hold every block, so they must "
                          f"add up to --n-layer {L} (got {first + last})")
    if L - first - last < others * v:
        raise ConfigError(f"{' and '.join(given)} leave {L - first - last} of --n-layer {L} blocks for the other "
                          f"{others} stage(s) x {v} chunk(s): every chunk needs a block; set the ends to at most "
                          f"{L - others * v} blocks together")


def _cp(cfg) -> None:
    """Context parallelism, in CLI terms."""
    if cfg.cp < 1:
        raise ConfigError(f"--cp must be at least 1, got {cfg.cp}")
    if cfg.cp == 1:
        return
    if cfg.block_size < 2 * cfg.cp:
        raise ConfigError(f"--cp {cfg.cp} cuts each sequence into {2 * cfg.cp} chunks: --block-size "
                          f"{cfg.block_size} is too short (at least {2 * cfg.cp})")


def _arch(cfg) -> None:
    """The architecture's options, in CLI terms (the model's own checks follow: GPTConfig.validate)."""
    if cfg.n_kv_head < 0 or cfg.intermediate_size < 0:
        raise ConfigError(f"--n-kv-head and --intermediate-size must be >= 0 (0: the default), got "
                          f"{cfg.n_kv_head} and {cfg.intermediate_size}")
    if cfg.sliding_window < 0:
        raise ConfigError(f"--sliding-window must be >= 0 (0: no window), got {cfg.sliding_window}")
    if cfg.tie_embeddings and cfg.untie_embeddings:
        raise ConfigError("use either --tie-embeddings or --untie-embeddings, not both")
    if cfg.arch == "gpt2":
        llama_only = ("n_kv_head", "rope_theta", "untie_embeddings", "tie_embeddings", "rope_scaling", "qkv_bias",
                      "sliding_window")
        given = _given(cfg, llama_only)
        if given:
            raise ConfigError(f"{', '.join(given)} set with --arch gpt2: llama options (pass --arch llama, "
                              "or drop them)")


def _moe(cfg) -> None:
    """The expert-parallel layout, in CLI terms."""
    E, ep = cfg.moe_experts, cfg.ep
    if ep < 1:
        raise ConfigError(f"--ep must be at least 1, got {ep}")
    if E == 0:
        set_ = _given(cfg, [f.name for f in fields(cfg) if f.name.startswith("moe_") and f.name != "moe_experts"])
        if set_:
            raise ConfigError(f"{', '.join(set_)} set on a dense model: pass --moe-experts E as well, or drop them")
    if cfg.etp < 0:
        raise ConfigError(f"--etp must be at least 1 (or 0: --tp's), got {cfg.etp}")
    if cfg.etp and E == 0:
        raise ConfigError(f"--etp {cfg.etp} needs a mixture-of-experts model: pass --moe-experts E, or drop --etp")
    if ep > 1 and E == 0:
        raise ConfigError(f"--ep {ep} needs a mixture-of-experts model: pass --moe-experts E (E >= {ep}), "
                          "or drop --ep")
    if E > 0 and ep > E:
        raise ConfigError(f"--ep {ep} exceeds --moe-experts {E}: some rank would hold no expert; use "
                          f"--ep <= {E} or more experts")
