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

    def validate(self, tp: int = 1) -> None:
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

    def to_dict(self) -> dict:
        return asdict(self)
