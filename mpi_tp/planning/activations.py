"""Activation memory per transformer layer, term by term: Korthikanti et al. 2022 (Table 2) and this code.

Legend (docs/notation.md): S = sequence, B = batch (a micro-batch), C = channels, H = heads,
T = tensor-parallel size. Korthikanti et al. write s, b, h, a, t for S, B, C, H, T.

What one block keeps for its backward pass, in the paper's terms (its section 4.1), each a
number of S B C, H S^2 B or S B elements, values or 1-byte dropout masks:

    term                          elements    TP      paper (16-bit)   here (float32)     bytes
    LayerNorm inputs              2 S B C     whole   4 S B C          8 S B C   (the normalised input)
    LayerNorm 1/std               2 S B       whole   -                8 S B     (ours: (B, S, 1), fp32)
    q/k/v input                   S B C       whole   2 S B C          4 S B C
    q, k                          2 S B C     1/T     4 S B C          8 S B C
    softmax output                H S^2 B     1/T     2 H S^2 B        4 H S^2 B
    softmax dropout mask          H S^2 B     1/T     H S^2 B          H S^2 B   (with dropout)
    softmax dropout output        H S^2 B     1/T     2 H S^2 B        -         (redone in the backward)
    v                             S B C       1/T     2 S B C          4 S B C
    attention projection input    S B C       1/T     2 S B C          4 S B C
    attention dropout mask        S B C       whole   S B C            S B C     (with dropout)
    fc input                      S B C       whole   2 S B C          4 S B C
    GELU input                    4 S B C     1/T     8 S B C          16 S B C
    GELU tanh                     4 S B C     1/T     -                16 S B C  (ours: saves a tanh)
    MLP projection input          4 S B C     1/T     8 S B C          16 S B C
    MLP dropout mask              S B C       whole   S B C            S B C     (with dropout)

At 16 bits (--precision bf16 or fp16) every value above takes 2 bytes, as in the paper, and the
per-row statistics (1/std, the online softmax's log-sum-exp) stay fp32, 4 bytes, as Megatron's do
(mpi_tp.core.kernels_half keeps the fp32 kernels' caches that way): the layer's bytes are 0.50x
fp32's, less the statistics' (1/C of a LayerNorm's) share.
"whole": every tensor-parallel rank keeps all of it under plain tensor parallelism; sequence
parallelism divides every term by T (the column layers keep their input's shard and gather it
again in the backward pass). The paper's sum: S B C (34 + 5 H S / C) bytes at T = 1,
S B C (10 + 24/T + 5 H S / (C T)) with TP, S B C (34 + 5 H S / C) / T with TP + SP.
Selective recomputation keeps neither the softmax output nor its dropout (the attention core
is run again); full recomputation keeps only the block's input, S B C values (1/T under SP).
From S = ONLINE_FROM positions attention runs the online softmax (mpi_tp.core.kernels_online),
which keeps the output (S B C / T) and each row's log-sum-exp (H S B / T) instead of the softmax
output, and no dropout mask: each tile's is drawn from its positions' counters when the tile is
computed, in the forward and again in the backward (mpi_tp.model.dropout.TileMasks).

`activation_terms` gives either count term by term; `measured_terms` reads the same terms off a
block's caches after a forward (mpi_tp.model.block.Block), for the experiment and the bench.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpi_tp.core.kernels_attention import ONLINE_FROM

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Term:
    name: str
    unit: str              # "SBC", "HSSB" (H S^2 B), "HSB", "SB", "SBF" (S B F) or "SBK" (S B hs max(H_kv, T))
    count: float           # how many units
    mask: bool             # a 1-byte dropout mask (else a value)
    split: bool            # divided by T under plain tensor parallelism (else kept whole)
    paper: bool            # in Korthikanti et al.'s count
    ours: bool             # kept by this implementation
    core: bool = False     # the attention core: not kept under selective recomputation
    online: bool | None = None   # True: kept only by the online softmax (S >= ONLINE_FROM), False: only without it
    statistic: bool = False      # a per-row statistic: fp32 (4 bytes) at 16 bits, the value width otherwise
    arch: str | None = None      # kept by this architecture's block only ("gpt2", "llama"), None: by both


@dataclass(frozen=True)
class Shape:
    """A block's shape beyond C and H (mpi_tp.planning.workload.Workload): H_kv key/value heads (None: H),
    the MLP's width F (None: 4C) and the architecture (llama: grouped-query k and v, a SwiGLU MLP)."""

    kv_heads: int | None = None
    ffn: int | None = None
    llama: bool = False

    @classmethod
    def of(cls, w) -> "Shape":
        return cls(w.kv_heads, w.ffn, w.llama)


TERMS = (
    Term("LayerNorm inputs", "SBC", 2, False, False, True, True),
    Term("LayerNorm 1/std", "SB", 2, False, False, False, True, statistic=True),
    Term("q/k/v input", "SBC", 1, False, False, True, True),
    Term("q, k", "SBC", 2, False, True, True, True, arch="gpt2"),
    Term("q", "SBC", 1, False, True, True, True, arch="llama"),
    Term("k", "SBK", 1, False, True, True, True, arch="llama"),
    Term("softmax output", "HSSB", 1, False, True, True, True, core=True, online=False),
    Term("attention output", "SBC", 1, False, True, False, True, online=True),
    Term("attention log-sum-exp", "HSB", 1, False, True, False, True, online=True, statistic=True),
    Term("softmax dropout mask", "HSSB", 1, True, True, True, True, core=True, online=False),
    Term("softmax dropout output", "HSSB", 1, False, True, True, False, core=True, online=False),
    Term("v", "SBC", 1, False, True, True, True, arch="gpt2"),
    Term("v", "SBK", 1, False, True, True, True, arch="llama"),
    Term("attention projection input", "SBC", 1, False, True, True, True),
    Term("attention dropout mask", "SBC", 1, True, False, True, True),
    Term("fc input", "SBC", 1, False, False, True, True),
    Term("GELU input", "SBF", 1, False, True, True, True, arch="gpt2"),
    Term("GELU tanh", "SBF", 1, False, True, False, True, arch="gpt2"),
    Term("SwiGLU gate, up", "SBF", 2, False, True, True, True, arch="llama"),
    Term("SwiGLU sigmoid, silu", "SBF", 2, False, True, False, True, arch="llama"),
    Term("MLP projection input", "SBF", 1, False, True, True, True),
    Term("MLP dropout mask", "SBC", 1, True, False, True, True),
)


def activation_terms(S: int, B: int, C: int, H: int, T: int = 1, sp: bool = False, dropout: bool = False,
                     recompute: str = "none", value_bytes: int | None = None, paper: bool = False,
                     online: bool | None = None, shape: Shape = Shape()) -> dict:
    """{term: bytes per layer} on the rank that keeps the most (sizes that divide by T: exact).

    paper: Korthikanti et al.'s count (dropout always on for GPT-2's shape, as in the paper's runs, and as
    `dropout` says for Llama's, which trains without it; values of value_bytes, default 2 as in the paper); else this code's with value_bytes per value (default 4: float32; statistics fp32 at 2) and
    masks only when dropout is on. online: the attention keeps no scores, its output and log-sum-exp
    instead (the online softmax, FlashAttention, ring attention); None: this code's rule (from
    ONLINE_FROM positions; never in the paper's count). shape: H_kv, F and the architecture (default
    GPT-2's: H, 4C)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: one of {RECOMPUTE}")
    if value_bytes is None:
        value_bytes = 2 if paper else 4
    if paper and not shape.llama:         # the GPT runs the paper counts had dropout; Llama trains without it
        dropout = True
    F, H_kv = shape.ffn or 4 * C, shape.kv_heads or H
    # SBK: k or v, split by key/value heads: H_kv / T heads a rank, or one whole (a replica) when H_kv < T
    units = {"SBC": S * B * C, "HSSB": H * S * S * B, "SB": S * B, "HSB": H * S * B, "SBF": S * B * F,
             "SBK": S * B * (C // H) * max(H_kv, T)}
    arch = "llama" if shape.llama else "gpt2"
    if online is None:
        online = not paper and S >= ONLINE_FROM
    if recompute == "full":                           # the block's input alone
        return {"block input": S * B * C * value_bytes / (T if sp else 1)}
    out = {}
    for t in TERMS:
        # flash adds its log-sum-exp to the paper's count; its output is the projection's input, counted already
        counted = (t.paper if paper else t.ours) or (paper and online and t.online and t.statistic)
        if not counted or (t.mask and not dropout) or t.online not in (None, online) or t.arch not in (None, arch):
            continue
        if t.core and recompute == "selective" and not online:      # (the online cache is kept whole)
            continue
        n = t.count * units[t.unit] / (T if (t.split or sp) else 1)
        out[t.name] = n * (1 if t.mask else max(value_bytes, 4) if t.statistic else value_bytes)
    return out


def activation_bytes_per_layer(S, B, C, H, T=1, sp=False, dropout=False, recompute="none", value_bytes=None,
                               paper=False, online=None, shape: Shape = Shape()) -> float:
    """The sum of activation_terms."""
    return sum(activation_terms(S, B, C, H, T, sp, dropout, recompute, value_bytes, paper, online, shape).values())


def measured_terms(block) -> dict:
    """{term: bytes} that a dense Block's caches keep after its forward (GPT-2's or Llama's), named as in
    TERMS; their sum equals block.activation_bytes() (every array accounted for once)."""
    if block.moe:
        raise ValueError("measured_terms reads a dense block (an MoE block keeps routing state too)")
    out = {}

    def add(name, *arrays):
        for a in arrays:
            if a is not None and hasattr(a, "nbytes"):
                out[name] = out.get(name, 0) + a.nbytes

    if block.recompute:
        x, _ = block._cache
        add("block input", x)
        return out
    for ln in (block.ln_1, block.ln_2):
        xhat, rstd = ln._cache
        add("LayerNorm inputs", xhat)
        add("LayerNorm 1/std", rstd)
    add("q/k/v input", block.attn.qkv._cache[0][0])
    attn = block.attn._cache[0]
    llama = block.attn.rope is not None
    if llama:
        add("q", attn[0])
        add("k", attn[1])
    else:
        add("q, k", attn[0], attn[1])
    add("v", attn[2])
    if block.attn._cache[1] == "online":                # the online softmax: output and lse (masks: by tile)
        add("attention output", attn[3])
        add("attention log-sum-exp", attn[4])
    elif not block.attn.recompute:
        add("softmax output", attn[3])
        add("softmax dropout mask", attn[4])
    add("attention projection input", block.attn.proj._cache[0])
    add("fc input", block.mlp.fc._cache[0][0])
    if llama:                                           # gate and up: views of the fused GEMM's output
        gate, up, sig, silu = block.mlp._cache[0]
        add("SwiGLU gate, up", gate, up)
        add("SwiGLU sigmoid, silu", sig, silu)
        add("MLP projection input", block.mlp.down._cache[0])
    else:
        gelu_in, tanh = block.mlp._cache[0]
        add("GELU input", gelu_in)
        add("GELU tanh", tanh)
        add("MLP projection input", block.mlp.proj._cache[0])
    m_a, m_h, _ = block._cache                          # (and the pass's masks key: no array)
    add("attention dropout mask", m_a)
    add("MLP dropout mask", m_h)
    return out
