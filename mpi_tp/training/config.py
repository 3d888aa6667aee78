"""Run configuration as data: one dataclass, JSON files, and --key=value overrides.

Precedence: defaults < --config FILE.json < command-line options (where a
configuration comes from, and --init-from's model: mpi_tp.training.config_sources).
The resolved configuration is written into every run's output folder
(config.json), so a run can be repeated with `mpi-tp train --config runs/X/config.json`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from mpi_tp.core.precision import precision
from mpi_tp.model.config import DISPATCHER_KINDS, ConfigError, GPTConfig
from mpi_tp.model.routing import DROP_POLICIES, ROUTERS, TOPK_NORMS
from mpi_tp.parallel.layout import RULE, Layout
from mpi_tp.training.config_checks import check
from mpi_tp.training.loss_scale import LossScaler
from mpi_tp.training.optim import SGD, AdamW


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
    rope_scaling: str = opt("", "llama: the rotary frequencies stretched, a JSON object: "
                            "{\"rope_type\": \"llama3\", \"factor\": 8, ...} (Llama 3.1-3.3), linear or dynamic "
                            "(mpi_tp.model.rope_scaling); empty: none")
    qkv_bias: bool = opt(False, "llama: biases on q, k and v (Qwen2)")
    sliding_window: int = opt(0, "llama: a query attends to its S_w latest positions, itself included (Mistral's "
                              "sliding window); 0: to every earlier position")
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
    first_stage_layers: int = opt(0, "blocks on the first pipeline stage, over all its chunks (0: an even share; "
                                  "Megatron-Core's --decoder-first-pipeline-num-layers; Llama 3 gives the first "
                                  "and last stages one block fewer); the other stages share the rest")
    last_stage_layers: int = opt(0, "blocks on the last pipeline stage (rank pp - 1; under zb-v its chunks are "
                                 "the model's middle two), over all its chunks (0: an even share; Megatron-Core's "
                                 "--decoder-last-pipeline-num-layers)")
    dp: int = opt(1, f"data-parallel size (replicas, each on micro_batches x batch_size sequences) ({RULE})")
    ep: int = opt(1, "expert-parallel size: each MoE block's experts divided among ep groups of a stage's "
                  "ranks (ep x etp must divide tp x cp x dp; the world size stays tp x cp x pp x dp)")
    etp: int = opt(0, "expert tensor-parallel size: each expert's columns/rows split over etp ranks, "
                   "independently of --tp (0: --tp's); the stage's tp x cp x dp ranks are laid out again as "
                   "etp x ep x edp for the experts (Megatron's rule)")
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

    def model_config(self, vocab_size: int = 256) -> GPTConfig:
        """The model to build; vocab_size: the data's, when the vocab_size option is 0."""
        tied = True if self.tie_embeddings else False if self.untie_embeddings else None    # None: arch's
        return GPTConfig(vocab_size=self.vocab_size or vocab_size, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout, arch=self.arch,
                         n_kv_head=self.n_kv_head or None, intermediate_size=self.intermediate_size or None,
                         rope_theta=self.rope_theta, norm_eps=self.norm_eps, tie_word_embeddings=tied,
                         rope_scaling=self.rope_scaling_dict(), qkv_bias=self.qkv_bias,
                         sliding_window=self.sliding_window or None,
                         **{f.name: getattr(self, f.name) for f in fields(GPTConfig) if f.name.startswith("moe_")})

    def rope_scaling_dict(self) -> dict | None:
        """--rope-scaling's JSON as a dict (None: ''); one ConfigError for what is not a JSON object."""
        if not self.rope_scaling:
            return None
        try:
            value = json.loads(self.rope_scaling)
        except ValueError as e:
            raise ConfigError(f"--rope-scaling {self.rope_scaling!r} is not JSON ({e}): write an object, e.g. "
                              '\'{"rope_type": "linear", "factor": 2}\'') from None
        if not isinstance(value, dict):
            raise ConfigError(f"--rope-scaling {self.rope_scaling!r}: a JSON object with a rope_type")
        return value

    def validate(self, world_size: int) -> None:
        """Refuse a configuration that cannot run on world_size ranks: one ConfigError (or TopologyError)
        that says what to change (mpi_tp.training.config_checks)."""
        check(self, world_size)

    def layout(self, world_size: int) -> Layout:
        """The layout of a job of world_size ranks (tp 0: what cp x pp x dp leave), checked: TopologyError
        names every rule it breaks."""
        return Layout.resolve(world_size, tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, ep=self.ep, etp=self.etp,
                              virtual=self.virtual_stages, sp=self.sequence_parallel, zero=self.zero)

    def to_dict(self) -> dict:
        return asdict(self)
