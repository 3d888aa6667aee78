"""Run configuration as data: one dataclass, JSON files, and --key=value overrides.

Precedence: defaults < --config FILE.json < command-line options (where a
configuration comes from, and --init-from's model: mpi_tp.training.config_sources).
The resolved configuration is written into every run's output folder
(config.json), so a run can be repeated with `mpi-tp train --config runs/X/config.json`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from mpi_tp.core.precision import precision
from mpi_tp.model.config import DISPATCHER_KINDS, ConfigError, GPTConfig
from mpi_tp.model.routing import DROP_POLICIES, ROUTERS, TOPK_NORMS
from mpi_tp.parallel.layout import RULE, Layout
from mpi_tp.training.loss_scale import LossScaler
from mpi_tp.training.optim import SGD, AdamW

MOE_OPTIONS = ("moe_top_k", "moe_every", "moe_capacity", "moe_aux_weight", "moe_z_weight", "moe_router", "moe_topk_norm",
               "moe_gate_scale", "moe_shared_experts", "moe_drop_policy", "moe_bias_rate",
               "moe_dispatcher")    # what a dense model refuses


def opt(default, help, choices=None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    # model (GPT-2 or Llama; see mpi_tp.model.config)
    arch: str = opt("gpt2", "architecture: 'gpt2' (LayerNorm, learned positions, biases, GELU MLP, tied output "
                    "layer) or 'llama' (RMSNorm, rotary positions, no biases, SwiGLU MLP, grouped-query "
                    "attention, untied output layer unless --tie-embeddings)", ["gpt2", "llama"])
    n_layer: int = opt(4, "transformer blocks")
    n_head: int = opt(4, "attention heads (split among tensor-parallel ranks; must divide n_embd)")
    n_kv_head: int = opt(0, "llama: key/value heads K, dividing n_head (fewer: grouped-query attention; "
                         "0: n_head)")
    n_embd: int = opt(128, "channels (hidden size C)")
    intermediate_size: int = opt(0, "MLP width F (0: 4C for gpt2, 8C/3 rounded up to a multiple of 8 for llama)")
    rope_theta: float = opt(10000.0, "llama: the base of the rotary position embeddings")
    norm_eps: float = opt(1e-5, "epsilon of the LayerNorms (gpt2) or RMSNorms (llama)")
    untie_embeddings: bool = opt(False, "llama: give the output layer its own table lm_head (the default)")
    tie_embeddings: bool = opt(False, "llama: tie the output layer to the token table wte, as gpt2 always does")
    block_size: int = opt(128, "context length in bytes (sequence length S)")
    dropout: float = opt(0.0, "dropout probability (attention, residual and embedding)")
    vocab_size: int = opt(0, "the model's vocabulary; 0: the data's (256 for bytes, a token file's own); "
                          "--init-from a Hugging Face folder makes the folder's the default")
    # mixture of experts (see mpi_tp.model.moe); moe_experts = 0 is the dense model
    moe_experts: int = opt(0, "experts per MoE block (0: a dense model)")
    moe_top_k: int = opt(1, "experts per token")
    moe_every: int = opt(1, "every N-th block is an MoE block (block i when i mod N = N - 1)")
    moe_capacity: float = opt(0.0, "capacity factor per sequence and expert: assignments past "
                              "ceil(factor * S * k / E) are dropped (0: dropless)")
    moe_aux_weight: float = opt(0.01, "weight of the load-balancing loss (Switch / GShard)")
    moe_z_weight: float = opt(0.0, "weight of the router z-loss (ST-MoE)")
    moe_router: str = opt("softmax", "router: 'softmax' (top-k of softmax over the experts: Switch, GShard), "
                          "'topk-softmax' (softmax over the top-k logits: Mixtral) or 'sigmoid' (a sigmoid per "
                          "expert: DeepSeek-V3)", list(ROUTERS))
    moe_topk_norm: str = opt("auto", "the k gates divided by their sum: 'sum', 'none', or 'auto' (sum when k > 1; "
                             "topk-softmax always)", list(TOPK_NORMS))
    moe_gate_scale: float = opt(1.0, "each gate multiplied by this (DeepSeek-V3's routed scaling factor, 2.5)")
    moe_shared_experts: int = opt(0, "shared experts every token goes through beside its k routed ones "
                                  "(DeepSeek): one MLP that many expert widths wide, tensor-parallel, on every ep rank")
    moe_bias_rate: float = opt(0.0, "the aux-loss-free balance (DeepSeek-V3): after each step every expert's "
                               "choice bias moves by this toward an even load (DeepSeek-V3: 0.001; 0: off)")
    moe_dispatcher: str = opt("alltoall", "how tokens reach their experts over --ep: 'alltoall' (each row to its "
                              "expert's rank and back) or 'allgather' (every row to every rank, the results "
                              "back by a reduce-scatter); the same numbers", list(DISPATCHER_KINDS))
    moe_drop_policy: str = opt("position", "which assignments past --moe-capacity are dropped: by 'position' "
                               "(later choice ranks, then later positions) or by 'probs' (the lowest gates)",
                               list(DROP_POLICIES))
    # parallel layout
    tp: int = opt(0, f"tensor-parallel size; 0 = world size / (cp * pp * dp) ({RULE})")
    cp: int = opt(1, "context-parallel size: each sequence cut into 2 cp chunks, two per rank, for the whole "
                  f"model; attention by ring attention ({RULE})")
    pp: int = opt(1, f"pipeline stages (consecutive runs of blocks on different ranks) ({RULE})")
    schedule: str = opt("1f1b", "pipeline schedule: 'gpipe' (all forwards, then all backwards), '1f1b' "
                        "(PipeDream-Flush), 'interleaved' (with --virtual-stages), 'zb-h1' (1f1b with each "
                        "backward cut into B and W, W in the bubble) or 'zb-v' (two chunks per stage in a V, "
                        "B and W cut: --virtual-stages 2) (Qi et al. 2024)",
                        ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"])
    virtual_stages: int = opt(1, "model chunks per pipeline stage (the interleaved schedule, micro_batches "
                              "then a multiple of pp; zb-v: 2)")
    dp: int = opt(1, f"data-parallel size (replicas, each on micro_batches x batch_size sequences) ({RULE})")
    ep: int = opt(1, "expert-parallel size: each MoE block's experts split over ep consecutive data-parallel "
                  "replicas (must divide dp; the world size stays tp x cp x pp x dp)")
    overlap_dp: bool = opt(True, "start the data-parallel gradient all-reduces during the backward pass "
                           "(--no-overlap-dp: after it)")
    bucket_mb: float = opt(8.0, "size of the data-parallel gradient buckets in MB")
    dp_allreduce: str = opt("flat", "data-parallel gradient all-reduce: 'flat' (one MPI all-reduce) or "
                            "'hierarchical' (inside each node, across nodes, back; MPI_TP_FAKE_NODES=k "
                            "emulates k nodes)", ["flat", "hierarchical"])
    sequence_parallel: bool = opt(False, "split the activations between the tensor-parallel regions along "
                                  "the sequence (Korthikanti et al. 2022): less activation memory, same traffic")
    zero: int = opt(0, "ZeRO stage, sharding over the data-parallel replicas (an expert's over the replicas "
                    "holding it): 1 the optimizer state; 2 also the gradients (each rank keeps its share once "
                    "reduce-scattered); 3 (FSDP) also the parameters, each layer's all-gathered before its "
                    "forward and its backward (1.5x the data-parallel bytes of 0-2); "
                    "the same numbers at every stage", [0, 1, 2, 3])
    recompute: str = opt("none", "activation recomputation: 'selective' keeps q, k, v and computes the attention "
                         "softmax again in the backward pass; 'full' keeps only each block's input and runs "
                         "its forward again (Korthikanti et al. 2022)", ["none", "selective", "full"])
    # data
    data: str = opt("pydoc", "'pydoc' (Python's reference docs, built in), 'shakespeare' (downloaded "
                    "once, cached) or a path to a text file")
    val_fraction: float = opt(0.1, "fraction of the corpus (at its end) held out for validation")
    # optimisation
    steps: int = opt(1000, "training steps")
    batch_size: int = opt(16, "sequences per micro-batch and replica (the global batch is "
                          "dp * micro_batches * batch_size)")
    micro_batches: int = opt(1, "micro-batches per step and replica: gradient accumulation, one optimizer "
                             "step after micro_batches forward/backward passes (the same numbers as one "
                             "batch of micro_batches * batch_size)")
    optimizer: str = opt("adamw", "optimizer", ["adamw", "sgd"])
    lr: float = opt(3e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "cosine decay ends at min_lr_ratio * lr")
    warmup: int = opt(50, "linear warm-up steps")
    weight_decay: float = opt(0.1, "decoupled weight decay on the matrices of linear layers")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    momentum: float = opt(0.9, "SGD momentum")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 = off)")
    on_nonfinite: str = opt("stop", "a NaN/inf loss or gradient: 'stop' (the last checkpoint stays as it is) "
                            "or 'skip' the step (at most 10 in a row)", ["stop", "skip"])
    # numerics and reproducibility
    seed: int = opt(1337, "seed of the initial weights, the batches and dropout")
    dtype: str = opt("float32", "parameter and activation dtype", ["float32", "float64"])
    precision: str = opt("fp32", "number format: 'fp32' (the --dtype above), or 'bf16' or 'fp16': parameters, "
                         "activations, gradients and their messages in bfloat16 or float16, products accumulated in "
                         "fp32 and rounded once, the optimizer's master weights and moments in fp32 "
                         "(mpi_tp.core.precision); fp16 with dynamic loss scaling", ["fp32", "bf16", "fp16"])
    fp32_grads: bool = opt(False, "bf16/fp16: accumulate the gradients in fp32 and reduce them over data "
                           "parallelism in fp32 (Megatron's --accumulate-allreduce-grads-in-fp32): twice the "
                           "gradient bytes and data-parallel wire bytes, no 16-bit rounding of their sums")
    initial_loss_scale: float = opt(65536.0, "fp16: the loss scale to start from (mpi_tp.training.loss_scale)")
    loss_scale_window: int = opt(1000, "fp16: double the loss scale after this many steps without an overflow "
                                 "(0: never)")
    loss_scale_backoff: float = opt(0.5, "fp16: multiply the loss scale by this after an overflow (that step is "
                                    "skipped on every rank)")
    min_loss_scale: float = opt(1.0, "fp16: the smallest loss scale; an overflow there is a divergence "
                                "(--on-nonfinite decides)")
    backend: str = opt("numpy", "array backend (cupy = GPUs, one per rank)", ["numpy", "cupy"])
    # output, checkpoints and reporting
    out: str = opt("", "output folder (default runs/<date-time>); checkpoints go to OUT/checkpoints")
    save_every: int = opt(0, "save a checkpoint every N steps (0: only at the end)")
    keep: int = opt(3, "keep the newest K checkpoints (0: all)")
    resume: bool = opt(False, "continue from the newest checkpoint in OUT/checkpoints, if there is one")
    overwrite: bool = opt(False, "start afresh in an --out that holds another run: it is moved aside to "
                                 "OUT.replaced-<date-time> first (nothing is deleted)")
    init_from: str = opt("", "continue from this checkpoint (a checkpoint folder or step-N folder), or start from "
                         "a Hugging Face GPT-2 or Llama folder (config.json, model.safetensors): its model "
                         "(arch, sizes, vocabulary, ...) becomes the default of the model options")
    log_every: int = opt(10, "print a progress line every N steps (rank 0)")
    trace: str = opt("", "write every rank's events (forward, backward, optimizer, pipeline actions, each "
                     "collective and send/receive with its bytes) to this file in the Chrome trace format, "
                     "for Perfetto or chrome://tracing (meant for short runs)")
    eval_every: int = opt(250, "estimate the validation loss every N steps (and at the end)")
    eval_batches: int = opt(20, "validation batches per estimate")
    sample_len: int = opt(300, "bytes of text to generate at the end (0 = none)")
    prompt: str = opt("The ", "prompt for the final sample")
    temperature: float = opt(0.8, "sampling temperature for the final sample")

    @property
    def model_dtype(self) -> str:
        """What the model's arrays are stored in: --dtype, or bfloat16 / float16 under --precision bf16 / fp16."""
        return self.dtype if self.precision == "fp32" else precision(self.precision).dtype

    def loss_scaler(self) -> LossScaler | None:
        """fp16's dynamic loss scaler as configured; None for the other formats (they need none)."""
        if self.precision != "fp16":
            return None
        return LossScaler(self.initial_loss_scale, self.loss_scale_window, self.loss_scale_backoff, self.min_loss_scale)

    def make_optimizer(self, params, reducer=None):
        """The optimizer --optimizer names, with this configuration's hyperparameters (reducer: the gradient
        reducer whose buckets a distributed optimizer updates, or None)."""
        if self.optimizer == "adamw":
            return AdamW(params, lr=self.lr, betas=(self.beta1, self.beta2), weight_decay=self.weight_decay,
                         reducer=reducer)
        return SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, reducer=reducer)

    def _validate_loss_scale(self) -> None:
        names = ("initial_loss_scale", "loss_scale_window", "loss_scale_backoff", "min_loss_scale")
        if self.precision != "fp16":
            default = {f.name: f.default for f in fields(self)}
            changed = [f"--{n.replace('_', '-')}" for n in names if getattr(self, n) != default[n]]
            if changed:
                raise ConfigError(f"{', '.join(changed)}: loss scaling is for --precision fp16 (bf16 has fp32's "
                                  "exponent range and needs none)")
            return
        try:
            self.loss_scaler()
        except ValueError as e:
            raise ConfigError(f"fp16 loss scaling: {e}") from None

    def _validate_precision(self) -> None:
        """16 bits' reach, in CLI terms: every layout (tp, sp, cp, pp, dp, ZeRO-1, ep); bf16 on NumPy, fp16
        on NumPy and CuPy; what they do not run with is one line each (a float64 checkpoint: build)."""
        if self.precision == "fp32":
            if self.fp32_grads:
                raise ConfigError("--fp32-grads is for --precision bf16 or fp16 (fp32 gradients are fp32 already)")
            return
        if self.dtype != "float32":
            raise ConfigError(f"--precision {self.precision} with --dtype {self.dtype}: 16-bit training keeps fp32 "
                              "masters (leave --dtype float32), or train in float64 with --precision fp32")
        if self.precision == "bf16" and self.backend != "numpy":   # emulated, it would save no byte
            raise ConfigError("--precision bf16 runs on --backend numpy only: CuPy has no bfloat16 dtype "
                              "(cupy/cupy#7527) and mpi_tp does not emulate it; use --precision fp16 (CuPy's "
                              "float16) or fp32 on CuPy")

    def model_config(self, vocab_size: int = 256) -> GPTConfig:
        """The model to build; vocab_size: the data's, when the vocab_size option is 0."""
        tied = True if self.tie_embeddings else False if self.untie_embeddings else None    # None: arch's
        return GPTConfig(vocab_size=self.vocab_size or vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout, arch=self.arch,
                         n_kv_head=self.n_kv_head or None, intermediate_size=self.intermediate_size or None,
                         rope_theta=self.rope_theta, norm_eps=self.norm_eps, tie_word_embeddings=tied,
                         moe_experts=self.moe_experts, moe_top_k=self.moe_top_k, moe_every=self.moe_every,
                         moe_capacity=self.moe_capacity, moe_aux_weight=self.moe_aux_weight,
                         moe_z_weight=self.moe_z_weight, moe_router=self.moe_router,
                         moe_topk_norm=self.moe_topk_norm, moe_gate_scale=self.moe_gate_scale,
                         moe_shared_experts=self.moe_shared_experts, moe_drop_policy=self.moe_drop_policy,
                         moe_bias_rate=self.moe_bias_rate, moe_dispatcher=self.moe_dispatcher)

    def validate(self, world_size: int) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"{f.name} = {getattr(self, f.name)!r}: choose one of "
                                  f"{', '.join(map(str, choices))}")
        for key in ("steps", "batch_size", "micro_batches", "log_every", "eval_every", "eval_batches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1, got {getattr(self, key)}")
        for key in ("warmup", "sample_len", "save_every", "keep", "vocab_size"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.lr <= 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")
        if self.resume and not self.out:
            raise ConfigError("--resume needs --out: the folder of the run to continue")
        if self.resume and self.init_from:
            raise ConfigError("use either --resume or --init-from, not both")
        if self.overwrite and self.resume:
            raise ConfigError("use either --resume (continue the run in --out) or --overwrite (move it aside and "
                              "start afresh), not both")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")
        if self.dp < 1 or self.pp < 1 or self.tp < 0 or self.virtual_stages < 1:
            raise ConfigError(f"dp, pp and virtual_stages must be at least 1 and tp at least 0 (0: world size "
                              f"/ (pp * dp)), got tp={self.tp} pp={self.pp} dp={self.dp} "
                              f"virtual_stages={self.virtual_stages}")
        if self.zero >= 2 and self.dp_allreduce == "hierarchical":
            raise ConfigError(f"--zero {self.zero} drops each bucket's gradients after its flat reduce-scatter: use "
                              "--dp-allreduce flat (or --zero 1 with the hierarchical all-reduce)")
        if self.schedule == "zb-v" and self.virtual_stages != 2:
            raise ConfigError(f"--schedule zb-v places two chunks per stage in a V: use --virtual-stages 2 "
                              f"(got {self.virtual_stages})")
        if self.virtual_stages > 1 and self.schedule not in ("interleaved", "zb-v"):
            raise ConfigError(f"--virtual-stages {self.virtual_stages} needs --schedule interleaved (or zb-v)")
        if self.schedule == "interleaved" and self.micro_batches % self.pp:
            raise ConfigError(f"the interleaved schedule needs a multiple of the {self.pp} pipeline stages as "
                              f"--micro-batches, got {self.micro_batches}")
        if self.n_layer < self.pp * self.virtual_stages:
            raise ConfigError(f"{self.n_layer} layers cannot fill {self.pp} pipeline stages x "
                              f"{self.virtual_stages} chunks: every chunk needs a block")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {self.bucket_mb}")
        self._validate_cp()
        self._validate_moe()
        self._validate_precision()
        self._validate_loss_scale()
        lay = self.layout(world_size)          # the world-size rule and the others: Layout.check
        self._validate_arch()
        self.model_config().validate(lay.tp, lay.ep)

    def _validate_cp(self) -> None:
        """Context parallelism, in CLI terms."""
        if self.cp < 1:
            raise ConfigError(f"--cp must be at least 1, got {self.cp}")
        if self.cp == 1:
            return
        if self.moe_experts:
            raise ConfigError(f"--cp {self.cp} runs dense models for now: drop --moe-experts, or use --cp 1")
        if self.block_size < 2 * self.cp:
            raise ConfigError(f"--cp {self.cp} cuts each sequence into {2 * self.cp} chunks: --block-size "
                              f"{self.block_size} is too short (at least {2 * self.cp})")

    def _validate_arch(self) -> None:
        """The architecture's options, in CLI terms (the model's own checks follow: GPTConfig.validate)."""
        if self.n_kv_head < 0 or self.intermediate_size < 0:
            raise ConfigError(f"--n-kv-head and --intermediate-size must be >= 0 (0: the default), got "
                              f"{self.n_kv_head} and {self.intermediate_size}")
        if self.tie_embeddings and self.untie_embeddings:
            raise ConfigError("use either --tie-embeddings or --untie-embeddings, not both")
        if self.arch == "gpt2":
            llama_only = ("n_kv_head", "rope_theta", "untie_embeddings", "tie_embeddings")
            given = [f"--{k.replace('_', '-')}" for k in llama_only if getattr(self, k) != getattr(TrainConfig, k)]
            if given:
                raise ConfigError(f"{', '.join(given)} set with --arch gpt2: llama options (pass --arch llama, "
                                  "or drop them)")

    def _validate_moe(self) -> None:
        """The expert-parallel layout, in CLI terms."""
        E, ep = self.moe_experts, self.ep
        if ep < 1:
            raise ConfigError(f"--ep must be at least 1, got {ep}")
        if E == 0:
            set_ = [f"--{k.replace('_', '-')}" for k in MOE_OPTIONS if getattr(self, k) != getattr(TrainConfig, k)]
            if set_:
                raise ConfigError(f"{', '.join(set_)} set on a dense model: pass --moe-experts E as well, or drop them")
        if ep > 1 and E == 0:
            raise ConfigError(f"--ep {ep} needs a mixture-of-experts model: pass --moe-experts E (E >= {ep}), "
                              "or drop --ep")
        if E > 0 and ep > E:
            raise ConfigError(f"--ep {ep} exceeds --moe-experts {E}: some rank would hold no expert; use "
                              f"--ep <= {E} or more experts")

    def layout(self, world_size: int) -> Layout:
        """The layout of a job of world_size ranks (tp 0: what cp x pp x dp leave), checked: TopologyError
        names every rule it breaks."""
        return Layout.resolve(world_size, tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep,
                              virtual=self.virtual_stages, sp=self.sequence_parallel, zero=self.zero)

    def to_dict(self) -> dict:
        return asdict(self)
