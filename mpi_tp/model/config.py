"""The model's configuration (GPT-2 style) and the error raised for one that cannot work."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.topology import TopologyError, check_splittable


class ConfigError(UserError, ValueError):
    """A model or run configuration that cannot work; the message says what to change."""


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64      # longest sequence (positions in wpe)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    # Mixture of experts (mpi_tp.model.moe); moe_experts = 0 is the dense model.
    moe_experts: int = 0          # E: experts in each MoE block
    moe_top_k: int = 1            # k: experts per token
    moe_every: int = 1            # block i is an MoE block when i % moe_every == moe_every - 1
    moe_capacity: float = 0.0     # capacity factor per sequence and expert; 0: dropless
    moe_aux_weight: float = 0.01  # weight of the load-balancing loss (Switch / GShard)
    moe_z_weight: float = 0.0     # weight of the router z-loss (ST-MoE)

    def is_moe_block(self, i: int) -> bool:
        """Whether block i's MLP is a mixture of experts."""
        return self.moe_experts > 0 and i % self.moe_every == self.moe_every - 1

    def validate(self, tp: int = 1, ep: int = 1) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"{key} must be a positive integer, got {getattr(self, key)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_head = {self.n_head} must divide n_embd = {self.n_embd} "
                              f"(head size = n_embd / n_head)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if tp > self.n_head:
            raise ConfigError(f"tensor-parallel size {tp} exceeds n_head = {self.n_head}: every rank "
                              f"needs at least one attention head; use at most {self.n_head} ranks "
                              f"or more heads")
        try:
            check_splittable(self.vocab_size, tp, "vocab_size")
        except TopologyError as e:
            raise ConfigError(str(e)) from None
        self._validate_moe(ep)

    def _validate_moe(self, ep: int) -> None:
        E, k = self.moe_experts, self.moe_top_k
        if not isinstance(E, int) or E < 0:
            raise ConfigError(f"moe_experts must be an integer >= 0 (0: a dense model), got {E!r}")
        if E == 0:
            if ep > 1:
                raise ConfigError(f"expert parallelism ep={ep} needs a mixture-of-experts model: set "
                                  "moe_experts > 0, or use ep=1")
            return
        if not isinstance(k, int) or not 1 <= k <= E:
            raise ConfigError(f"moe_top_k = {k!r} must be an integer in [1, moe_experts = {E}]")
        if not isinstance(self.moe_every, int) or not 1 <= self.moe_every <= self.n_layer:
            raise ConfigError(f"moe_every = {self.moe_every!r} must be in [1, n_layer = {self.n_layer}] "
                              "(block i is an MoE block when i % moe_every == moe_every - 1)")
        for key in ("moe_capacity", "moe_aux_weight", "moe_z_weight"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and 0.0 <= value < float("inf")):
                raise ConfigError(f"{key} must be a finite number >= 0, got {value!r}")
        if ep > E:
            raise ConfigError(f"{E} experts cannot be divided among ep={ep} expert-parallel ranks (some "
                              f"rank would hold none): use ep <= {E} or more experts")

    def to_dict(self) -> dict:
        return asdict(self)


def fewest_heads(C: int, T: int) -> int:
    """The fewest attention heads, at least 2 where C allows, that divide C and give each of T ranks one
    (C >= T): the default of the lessons and the exercises, whose tiny models choose no head count."""
    return min([h for h in range(max(T, 2), C + 1) if C % h == 0] or [C])
