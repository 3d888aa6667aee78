"""The model's configuration (GPT-2 or Llama) and the error raised for one that cannot work.

arch "gpt2": LayerNorm, learned positions (wpe), biases, a GELU MLP of width 4C, the output layer tied
to the token table. arch "llama" (mpi_tp.model.llama lists its parameters): RMSNorm, rotary positions,
no biases, a SwiGLU MLP, grouped-query attention (n_kv_head), the output layer tied or its own.
Fields left None take their architecture's default (`resolved()`); a configuration saved before a
field existed loads with its default (arch "gpt2").
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from mpi_tp.core.errors import UserError
from mpi_tp.model.routing import DROP_POLICIES, ROUTERS, TOPK_NORMS

DISPATCHER_KINDS = ("alltoall", "allgather")      # mpi_tp.parallel.expert_parallel.DISPATCHERS
from mpi_tp.parallel.topology import TopologyError, check_splittable


class ConfigError(UserError, ValueError):
    """A model or run configuration that cannot work; the message says what to change."""


class ShapeRules:
    """The defaults an architecture gives its shape, for every class that holds one (GPTConfig; the planner's
    Workload): fields arch, n_head, n_kv_head, n_embd, intermediate_size, and tie_setting (the tying asked for,
    None: the architecture's)."""

    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    @property
    def kv_heads(self) -> int:
        """H_kv: key/value heads (n_head unless grouped-query attention)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn(self) -> int:
        """F: the MLP's width (an expert's too): intermediate_size, or 4C (gpt2), llama_width(C) (llama)."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return llama_width(self.n_embd) if self.llama else 4 * self.n_embd

    @property
    def tied(self) -> bool:
        """Whether the output layer is the token table wte (else its own table lm_head): gpt2 always, llama
        when asked."""
        return (not self.llama) if self.tie_setting is None else bool(self.tie_setting)


@dataclass
class GPTConfig(ShapeRules):
    vocab_size: int = 256
    block_size: int = 64      # longest sequence (positions in wpe)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    arch: str = "gpt2"            # "gpt2" or "llama"
    n_kv_head: int | None = None  # H_kv key/value heads (llama; < n_head: grouped-query attention); None: n_head
    intermediate_size: int | None = None   # F, the MLP width; None: 4C (gpt2), llama_width(C) (llama)
    rope_theta: float = 10000.0   # llama: the rotary embeddings' base
    norm_eps: float = 1e-5        # the LayerNorms' (gpt2) or RMSNorms' (llama) epsilon
    tie_word_embeddings: bool | None = None   # output layer = wte; None: True (gpt2, always), False (llama)
    rope_scaling: dict | None = None   # llama: the rotary frequencies stretched (mpi_tp.model.rope_scaling)
    qkv_bias: bool = False        # llama: biases on q, k and v (Qwen2)
    sliding_window: int | None = None   # llama: S_w, a query sees its S_w latest positions, itself included (Mistral);
    #                                     None: every earlier position
    # Mixture of experts (mpi_tp.model.moe); moe_experts = 0 is the dense model.
    moe_experts: int = 0          # E: experts in each MoE block
    moe_top_k: int = 1            # k: experts per token
    moe_every: int = 1            # block i is an MoE block when i % moe_every == moe_every - 1
    moe_capacity: float = 0.0     # capacity factor per sequence and expert; 0: dropless
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss (Switch / GShard)
    moe_z_weight: float = 0.0     # weight of the router z-loss (ST-MoE)
    moe_router: str = "softmax"   # "softmax", "topk-softmax" (Mixtral) or "sigmoid" (DeepSeek-V3): model.routing
    moe_topk_norm: str = "auto"   # the k gates divided by their sum: "sum", "none", "auto" (sum when k > 1)
    moe_gate_scale: float = 1.0   # each gate times this (DeepSeek-V3's routed_scaling_factor)
    moe_shared_experts: int = 0   # experts every token goes through, beside its k routed ones (DeepSeek)
    moe_drop_policy: str = "position"   # past the capacity, drop by "position" (choice rank, then position)
    #                                     or by "probs" (the lowest gates first)
    moe_bias_rate: float = 0.0    # the aux-loss-free balance's bias step (DeepSeek-V3: 0.001); 0: the bias stays 0
    moe_dispatcher: str = "alltoall"    # how tokens reach their experts over ep: "alltoall" or "allgather"


    @property
    def tie_setting(self) -> bool | None:
        return self.tie_word_embeddings

    def resolved(self) -> "GPTConfig":
        """A copy with every None replaced by the value it stands for (to compare two configurations)."""
        return replace(self, n_kv_head=self.kv_heads, intermediate_size=self.ffn, tie_word_embeddings=self.tied)

    def is_moe_block(self, i: int) -> bool:
        """Whether block i's MLP is a mixture of experts."""
        return self.moe_experts > 0 and i % self.moe_every == self.moe_every - 1

    def validate(self, tp: int = 1, ep: int = 1, etp: int | None = None) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"{key} must be a positive integer, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_head = {self.n_head} must divide n_embd = {self.n_embd} "
                              f"(head size = n_embd / n_head)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        self._validate_arch(tp)
        if tp > self.n_head:
            raise ConfigError(f"tensor-parallel size {tp} exceeds n_head = {self.n_head}: every rank "
                              f"needs at least one attention head; use at most {self.n_head} ranks "
                              f"or more heads")
        try:
            check_splittable(self.vocab_size, tp, "vocab_size")
        except TopologyError as e:
            raise ConfigError(str(e)) from None
        self._validate_moe(ep, tp if etp is None else etp)

    def _validate_arch(self, tp: int) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"arch {self.arch!r}: use one of {', '.join(ARCHS)}")
        H_kv, F = self.n_kv_head, self.intermediate_size
        if H_kv is not None and (not _is_int(H_kv) or H_kv < 1 or self.n_head % H_kv):
            raise ConfigError(f"n_kv_head = {H_kv!r} must be a positive integer dividing n_head = {self.n_head} "
                              "(each key/value head serves n_head / n_kv_head query heads)")
        if F is not None and (not _is_int(F) or F < 1):
            raise ConfigError(f"intermediate_size = {F!r} must be a positive integer (the MLP width)")
        if self.ffn < tp:
            raise ConfigError(f"intermediate_size = {self.ffn} cannot be split over {tp} tensor-parallel ranks: "
                              f"use a width of at least {tp}")
        for key in ("rope_theta", "norm_eps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"{key} must be a finite number > 0, got {value!r}")
        if self.tie_word_embeddings not in (None, True, False):
            raise ConfigError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if not self.llama and (self.rope_scaling is not None or self.qkv_bias or self.sliding_window is not None):
            raise ConfigError("rope_scaling, qkv_bias and sliding_window are llama options (arch gpt2 has learned "
                              "positions, biases everywhere and full causal attention)")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"sliding_window = {window!r}: a query's window is a whole number of positions >= 1 "
                              "(itself included), or none")
        if self.llama:
            from mpi_tp.model.rope_scaling import RopeScalingError, check_rope_scaling
            try:
                self.rope_scaling = check_rope_scaling(self.rope_scaling, self.block_size)
            except RopeScalingError as e:
                raise ConfigError(str(e)) from None
            if (self.n_embd // self.n_head) % 2:
                raise ConfigError(f"rotary embeddings rotate pairs of a head's dimensions: the head size "
                                  f"n_embd / n_head = {self.n_embd // self.n_head} must be even")
            return
        if self.kv_heads != self.n_head:
            raise ConfigError(f"n_kv_head = {H_kv} with arch gpt2: grouped-query attention is a llama option "
                              "(use --arch llama, or drop --n-kv-head)")
        if not self.tied:
            raise ConfigError("arch gpt2 always ties its output layer to wte: --untie-embeddings "
                              "(tie_word_embeddings false) needs --arch llama")

    def _validate_moe(self, ep: int, etp: int) -> None:
        E, k = self.moe_experts, self.moe_top_k
        if not isinstance(E, int) or E < 0:
            raise ConfigError(f"moe_experts must be an integer >= 0 (0: a dense model), got {E!r}")
        if E == 0:
            if ep > 1:
                raise ConfigError(f"expert parallelism ep={ep} needs a mixture-of-experts model: set "
                                  "moe_experts > 0, or use ep=1")
            return
        if self.ffn < etp:
            raise ConfigError(f"an expert's width {self.ffn} cannot be split over etp={etp} expert tensor-parallel "
                              f"ranks: use etp <= {self.ffn}")
        if not isinstance(k, int) or not 1 <= k <= E:
            raise ConfigError(f"moe_top_k = {k!r} must be an integer in [1, moe_experts = {E}]")
        if not isinstance(self.moe_every, int) or not 1 <= self.moe_every <= self.n_layer:
            raise ConfigError(f"moe_every = {self.moe_every!r} must be in [1, n_layer = {self.n_layer}] "
                              "(block i is an MoE block when i % moe_every == moe_every - 1)")
        for key in ("moe_capacity", "moe_aux_weight", "moe_z_weight"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0.0 <= value < float("inf")):
                raise ConfigError(f"{key} must be a finite number >= 0, got {value!r}")
        for key, choices in (("moe_router", ROUTERS), ("moe_topk_norm", TOPK_NORMS),
                             ("moe_drop_policy", DROP_POLICIES), ("moe_dispatcher", DISPATCHER_KINDS)):
            if getattr(self, key) not in choices:
                raise ConfigError(f"{key} = {getattr(self, key)!r}: choose one of {', '.join(choices)}")
        if self.moe_router == "topk-softmax" and self.moe_topk_norm == "none":
            raise ConfigError("moe_router topk-softmax normalises the k gates by definition (a softmax over "
                              "them): drop moe_topk_norm none, or use moe_router softmax")
        if not (isinstance(self.moe_bias_rate, (int, float)) and 0.0 <= self.moe_bias_rate < float("inf")):
            raise ConfigError(f"moe_bias_rate must be a finite number >= 0 (0: no bias), got {self.moe_bias_rate!r}")
        if not (isinstance(self.moe_gate_scale, (int, float)) and 0.0 < self.moe_gate_scale < float("inf")):
            raise ConfigError(f"moe_gate_scale must be a finite number > 0, got {self.moe_gate_scale!r}")
        if not _is_int(self.moe_shared_experts) or self.moe_shared_experts < 0:
            raise ConfigError(f"moe_shared_experts must be an integer >= 0, got {self.moe_shared_experts!r}")
        if ep > E:
            raise ConfigError(f"{E} experts cannot be divided among ep={ep} expert-parallel ranks (some "
                              f"rank would hold none): use ep <= {E} or more experts")

    def to_dict(self) -> dict:
        return asdict(self)


ARCHS = ("gpt2", "llama")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def llama_width(C: int) -> int:
    """The default SwiGLU width: 8C/3 (the parameters of a 4C two-matrix MLP in three matrices), rounded
    up to a multiple of 8 (Llama rounds to 256; that would more than double a tiny model's MLP)."""
    width = -(-8 * C // 3)                             # ceil(8C / 3)
    return -(-width // 8) * 8


def fewest_heads(C: int, T: int) -> int:
    """The fewest attention heads, at least 2 where C allows, that divide C and give each of T ranks one
    (C >= T): the default of the lessons and the exercises, whose tiny models choose no head count."""
    return min([h for h in range(max(T, 2), C + 1) if C % h == 0] or [C])
