"""The model the cost model prices (Workload): its shape, GPT-2's or Llama's, and what that shape counts.

Legend (docs/notation.md): L layers, C channels, H query heads, H_kv key/value heads, hs = C / H the head
size, F the MLP's width, V vocabulary, S sequence, T tensor-parallel ranks.

    arch "gpt2"    LayerNorms (weight and bias), biases on every linear layer, a GELU MLP of width F = 4C
                   (fc C x F, proj F x C), learned positions (wpe, S C), the output layer tied to wte
    arch "llama"   RMSNorms (a weight), no biases, a SwiGLU MLP (gate and up C x F, down F x C: 3 C F),
                   grouped-query attention (k and v C x H_kv hs each: q/k/v together C x (C + 2 C H_kv / H)),
                   rotary positions (no table), the output layer its own table lm_head unless tied

Per block (mpi_tp.model.llama.parameter_shapes lists llama's; gpt2 with F = 4C: 12 C^2 + 13 C):

    attention   C (C + 2 C H_kv / H) + C^2          gpt2: + (C + 2 C H_kv / H) + C biases
    MLP         m C F, m = 2 (gpt2) or 3 (llama)     gpt2: + F + C biases
    norms       4 C (gpt2) or 2 C (llama)

and once: wte V C, lm_head V C (untied), wpe S C (gpt2), the final norm 2 C (gpt2) or C (llama).
Tensor parallelism (mpi_tp.model.heads) splits q, k, v and the output projection by heads, the MLP by
its F columns, wte and lm_head by vocabulary rows; with H_kv < T every rank holds one key/value head
whole, a replica (k and v: 2 C hs on every rank). GEMM multiply-adds per position of one block, on the
rank with the most heads and MLP columns (layer_macs): 2 C^2 ceil(H/T)/H for q and the projection,
2 C hs ceil(H_kv/T) for k and v, m C F ceil(F/T)/F for the MLP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mpi_tp.model.config import ARCHS, ShapeRules


@dataclass
class Workload(ShapeRules):
    n_layer: int
    n_embd: int
    n_head: int
    seq: int
    global_batch: int
    vocab: int = 256
    dropout: bool = False        # 1-byte masks among the activations (mpi_tp.planning.activations)
    experts: int = 0             # E experts in each MoE block (0: dense); block i is one when i % every = every - 1
    top_k: int = 1               # k experts per token
    moe_every: int = 1
    shared_experts: int = 0      # n shared experts (one MLP n wide) beside the routed ones
    capacity: float = 0.0        # moe_capacity c: an expert admits at most c S k / E of a sequence's rows (0: dropless)
    arch: str = "gpt2"           # "gpt2" or "llama" (the module docstring)
    n_kv_head: int | None = None         # H_kv (None: n_head; fewer under llama: grouped-query attention)
    intermediate_size: int | None = None  # F (None: 4C for gpt2, 8C/3 rounded up to a multiple of 8 for llama)
    tie_embeddings: bool | None = None   # the output layer is wte (None: gpt2 tied, llama untied: lm_head)
    attention: str = "auto"      # the kernel: "flash", "stored", "mpi_tp" or "auto" (mpi_tp.planning.attention_cost)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r}: one of {', '.join(ARCHS)}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_head {self.kv_heads} must divide n_head {self.n_head}")
        if not self.llama and (self.kv_heads != self.n_head or not self.tied):
            raise ValueError("grouped-query attention and an untied output layer are llama's (arch gpt2 has "
                             "neither)")

    @property
    def tie_setting(self) -> bool | None:
        return self.tie_embeddings

    @property
    def qkv_width(self) -> int:
        """The q/k/v GEMM's output columns: C + 2 C H_kv / H (3 C with every head its own k and v)."""
        return self.n_embd + 2 * self.n_embd * self.kv_heads // self.n_head

    @property
    def mlp_matrices(self) -> int:
        """m: the MLP's C x F matrices (gpt2 fc and proj: 2; llama's SwiGLU gate, up and down: 3)."""
        return 3 if self.llama else 2

    @property
    def mlp_macs(self) -> int:
        """Multiply-adds per position of one whole MLP: m C F."""
        return self.mlp_matrices * self.n_embd * self.ffn

    @property
    def mlp_kept(self) -> int:
        """F-wide arrays one MLP keeps per position for its backward pass (this code's): gpt2 3 (the GELU's
        input, its tanh, proj's input), llama 5 (gate, up, the sigmoid, silu, down's input)."""
        return 5 if self.llama else 3

    @property
    def biases(self) -> bool:
        return not self.llama

    @property
    def moe_layers(self) -> int:
        return self.n_layer // self.moe_every if self.experts else 0

    def mlp_params(self, width: int = 1) -> int:
        """An MLP `width` widths F wide (the shared experts are one such): m C F width, gpt2 with its biases
        (fc's F width, proj's C); 0 wide: none."""
        if not width:
            return 0
        C = self.n_embd
        return width * (self.mlp_matrices * C * self.ffn + self.ffn * self.biases) + C * self.biases

    @property
    def expert_params(self) -> int:
        """One expert's MLP (gpt2: 8 C^2 + 5 C, fc, proj and their biases; llama: 3 C F)."""
        return self.mlp_params(1)

    def layer_split(self, T: int = 1) -> tuple[int, int]:
        """(split, whole): one dense block's parameters that T tensor-parallel ranks divide among them (q/k/v
        by heads, the projection's rows, the MLP's F columns), and those every rank holds (norms, row biases;
        with H_kv < T one key/value head's k and v, replicated). gpt2: (12 C^2 + 7 C, 6 C)."""
        C, Q = self.n_embd, self.qkv_width
        kv = (Q - C) * C                                             # k and v: C x 2 C H_kv / H
        replicated = self.kv_heads < T
        split = C * Q + C * C + self.mlp_matrices * C * self.ffn - (kv if replicated else 0)
        whole = (4 if self.biases else 2) * C + (2 * C * (C // self.n_head) if replicated else 0)
        if self.biases:
            split, whole = split + Q + self.ffn, whole + 2 * C      # q/k/v's and fc's biases split, the rows' whole
        return split, whole

    @property
    def final_norm_params(self) -> int:
        return (2 if self.biases else 1) * self.n_embd

    @property
    def position_params(self) -> int:
        """wpe's S C (gpt2's learned positions; llama's rotary ones have no table)."""
        return 0 if self.llama else self.seq * self.n_embd

    @property
    def params(self) -> float:
        """Parameters: L (attention + MLP + norms) + V C (wte) + V C (lm_head, untied) + S C (wpe, gpt2) + the
        final norm; gpt2: 12 L C^2 (+ biases, LayerNorms) + V C + S C (tied embedding, positions)."""
        L, h = self.n_layer, self.n_embd
        shared = self.mlp_params(self.shared_experts)                # one MLP n wide
        moe = self.moe_layers * ((self.experts - 1) * self.expert_params + shared + h * self.experts)
        split, whole = self.layer_split()
        head = 0 if self.tied else self.vocab * h
        return L * (split + whole) + self.vocab * h + head + self.position_params + self.final_norm_params + moe

    def layer_macs(self, T: int = 1) -> float:
        """GEMM multiply-adds per position of one dense block on the rank with the most heads and MLP columns
        (the module docstring); gpt2: 4 C^2 ceil(H/T)/H + 8 C^2 ceil(4C/T)/(4C)."""
        C, H, H_kv, F = self.n_embd, self.n_head, self.kv_heads, self.ffn
        q_proj = 2 * C * C * (math.ceil(H / T) / H)                   # q and the output projection
        kv = 2 * C * (C * H_kv // H) * (math.ceil(H_kv / T) / H_kv)  # k and v: one whole head each when H_kv < T
        return q_proj + kv + self.mlp_macs * (math.ceil(F / T) / F)

    def shape_text(self) -> str:
        """'L=24, C=2048, H=16' and, under llama, H_kv, F and whether the output layer is tied."""
        text = f"L={self.n_layer}, C={self.n_embd}, H={self.n_head}"
        if self.llama:
            text += f", H_kv={self.kv_heads}, F={self.ffn}, llama, {'tied' if self.tied else 'untied'}"
        elif self.ffn != 4 * self.n_embd:
            text += f", F={self.ffn}"
        return text
