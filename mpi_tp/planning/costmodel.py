"""A cost model of a training step: alpha-beta collectives, a GEMM/memory roofline, memory per rank.

Everything is per rank and per training step, for a GPT of L layers, hidden h,
a heads, vocabulary V, sequence s, global batch B, on a layout of tp x pp x dp
ranks with micro-batches of b sequences (m = B / (dp b) of them per step).

    compute      GEMM FLOPs / gemm_flops
                 + elementwise work: (ew_rep sbh + ew_par sbh / tp + ew_att a s^2 b / tp) per layer
                   and micro-batch, in elements, over elem_rate (elements per second)
    tensor par.  4 all-reduces of b s h values per layer and micro-batch (2 forward, 2 backward;
                 6 with recomputation), ring: 2 (p-1) alpha + 2 (p-1)/p n / bw
    pipeline     bubble (pp - 1) / m of the compute, plus 2 (pp - 1) activation sends per micro-batch
    data par.    one all-reduce of the rank's gradients (params / (tp pp) values) over dp
    optimizer    opt_bytes_per_param x params per rank / mem_bw (ZeRO-1: / dp, plus an all-gather)

A link is intra-node when the group fits in a node (tensor-parallel groups are
consecutive ranks, data-parallel groups stride over them), else the network.
Memory per rank: weights, gradients and optimizer state (ZeRO-1 divides the
latter by dp) of the rank's layers, plus activations: our own count per layer
(docs/parallelism.md) for implementations like this one, Korthikanti et al.'s
for Megatron-style 16-bit training, times the micro-batches in flight (pp for
1F1B); with recomputation only each layer's input (2 sbh bytes in 16-bit) and
one layer's full activations.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from mpi_tp.core.errors import UserError


@dataclass
class Machine:
    name: str
    ranks_per_node: int            # GPUs (or CPU ranks) per node
    gemm_flops: float              # sustained GEMM FLOP/s per rank
    elem_rate: float               # elementwise work: activation elements processed per second per rank
    mem_bw: float                  # bytes/s per rank for the optimizer's streaming update
    mem_bytes: float               # memory per rank
    intra_alpha: float             # seconds per collective step inside a node
    intra_bw: float                # bytes/s per rank inside a node (collective bus bandwidth)
    inter_alpha: float
    inter_bw: float                # bytes/s per rank across nodes
    bytes_per_value: int = 4       # activations and communication (2: fp16/bf16)
    opt_traffic_per_param: int = 28  # bytes the optimizer reads+writes per parameter and step
    state_bytes_per_param: int = 16  # weights + grads + optimizer moments kept per parameter
    ew_rep: float = 40.0           # elementwise elements per s b h per layer not split by TP
    ew_par: float = 60.0           # ... split by TP
    ew_att: float = 10.0           # ... per a s^2 b (softmax and friends), split by TP
    activations: str = "mpi_tp"    # "mpi_tp" (our count, float32) or "korthikanti" (16-bit Megatron)
    peak_flops: float = 0.0        # the datasheet peak per rank that papers quote fractions of (0: gemm_flops)
    source: str = ""

    @classmethod
    def load(cls, path: str) -> "Machine":
        with open(path) as f:
            data = json.load(f)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UserError(f"machine file {path!r}: unknown keys {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)


@dataclass
class Workload:
    n_layer: int
    n_embd: int
    n_head: int
    seq: int
    global_batch: int
    vocab: int = 256

    @property
    def params(self) -> float:
        """Parameters: 12 L h^2 (+ biases, LayerNorms) + V h + s h (tied embedding, positions)."""
        L, h = self.n_layer, self.n_embd
        return L * (12 * h * h + 13 * h) + self.vocab * h + self.seq * h + 2 * h


@dataclass
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    sp: bool = False
    zero: int = 0
    recompute: bool = False
    virtual: int = 1             # model chunks per pipeline stage (the interleaved schedule)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        extra = "".join([f" v{self.virtual}" if self.virtual > 1 else "", " +sp" if self.sp else "",
                         " +zero1" if self.zero else "", " +recompute" if self.recompute else ""])
        return f"tp{self.tp} pp{self.pp} dp{self.dp} b{self.micro_batch}{extra}"


def ring_all_reduce(n_bytes: float, p: int, alpha: float, bw: float) -> float:
    return 0.0 if p <= 1 else 2 * (p - 1) * alpha + 2 * (p - 1) / p * n_bytes / bw


def ring_all_gather(n_bytes: float, p: int, alpha: float, bw: float) -> float:
    """Also the time of a reduce-scatter of n bytes."""
    return 0.0 if p <= 1 else (p - 1) * alpha + (p - 1) / p * n_bytes / bw


def hierarchical_all_reduce(n_bytes: float, p: int, per_node: int, m: Machine) -> float:
    """Reduce inside the node, all-reduce among one rank per node, broadcast back (trees inside)."""
    local = min(p, per_node)
    nodes = max(1, p // local)
    inside = 2 * (math.ceil(math.log2(local)) * m.intra_alpha + n_bytes / m.intra_bw) if local > 1 else 0.0
    return inside + ring_all_reduce(n_bytes, nodes, m.inter_alpha, m.inter_bw)


def _link(group_span: int, m: Machine):
    """(alpha, bw) for a group whose members span group_span consecutive ranks."""
    return (m.intra_alpha, m.intra_bw) if group_span <= m.ranks_per_node else (m.inter_alpha, m.inter_bw)


def step_time(m: Machine, w: Workload, lay: Layout, hierarchical_dp: bool = False) -> dict:
    """Seconds per training step and their parts, per rank."""
    L, h, a, s, V = w.n_layer, w.n_embd, w.n_head, w.seq, w.vocab
    t, p, d, b = lay.tp, lay.pp, lay.dp, lay.micro_batch
    micro = w.global_batch / (d * b)                           # micro-batches per replica and step
    layers = math.ceil(L / p)                                  # the largest stage sets the pace
    fwd_bwd = 4 if lay.recompute else 3                        # forward counted again when recomputing
    # the rank with the most heads (and MLP columns) sets the pace when they do not divide by t
    att_share, mlp_share = math.ceil(a / t) / a, math.ceil(4 * h / t) / (4 * h)
    gemm = fwd_bwd * 2 * b * s * (4 * h * h * att_share + 8 * h * h * mlp_share) * layers   # 2 FLOPs per MAC
    gemm += fwd_bwd * 2 * b * s * s * h * 2 * att_share * layers                           # QK^T and AV
    gemm += 3 * 2 * b * s * h * V / t / p                      # the tied head, on one stage's share
    elem = layers * (m.ew_rep * s * b * h / (t if lay.sp else 1) + m.ew_par * s * b * h / t
                     + m.ew_att * a * s * s * b / t) * (fwd_bwd / 3)
    compute = micro * (gemm / m.gemm_flops + elem / m.elem_rate)
    alpha, bw = _link(t, m)
    n = b * s * h * m.bytes_per_value
    per_layer = (6 if lay.recompute else 4) * ring_all_reduce(n, t, alpha, bw)   # SP: same bytes (RS + AG)
    tp_comm = micro * layers * per_layer
    pp_comm, bubble = 0.0, 0.0
    if p > 1:
        pa, pbw = _link(t * p, m)
        v = lay.virtual                                        # V chunks: more messages, 1/V the bubble
        # each message is 1/t of b s h (scatter/gather: all-gathered on arrival unless under sp);
        # per step a stage sends, on average, 2 (p v - 1) / p messages per micro-batch
        message = pa + n / t / pbw + (0.0 if lay.sp else ring_all_gather(n, t, alpha, bw))
        pp_comm = micro * 2 * (p * v - 1) / p * message
        bubble = (p - 1) / (v * micro) * (compute + tp_comm)
    params_rank = w.params / (t * p)
    grad_bytes = params_rank * 4
    if d > 1 and hierarchical_dp:
        dp_comm = hierarchical_all_reduce(grad_bytes, d, max(1, m.ranks_per_node // (t * p)), m)
    else:
        da, dbw = _link(t * p * d, m)
        dp_comm = ring_all_reduce(grad_bytes, d, da, dbw)
    opt = params_rank * m.opt_traffic_per_param / m.mem_bw / (d if lay.zero else 1)
    if lay.zero and d > 1:
        da, dbw = _link(t * p * d, m)
        opt += ring_all_gather(grad_bytes, d, da, dbw)
    total = compute + tp_comm + pp_comm + bubble + dp_comm + opt
    return {"total": total, "compute": compute, "tp_comm": tp_comm, "pp_comm": pp_comm, "bubble": bubble,
            "dp_comm": dp_comm, "optimizer": opt, "micro_batches": micro}


def model_flops_per_step(w: Workload) -> float:
    """The model's FLOPs per training step, forward and backward, recomputation not counted (as papers
    report achieved FLOP/s): 72 B s l h^2 (1 + s / (6 h)) + 6 B s h V (Narayanan et al. 2021, eq. 3
    without its recomputed forward)."""
    B, s, l, h, V = w.global_batch, w.seq, w.n_layer, w.n_embd, w.vocab
    return 72 * B * s * l * h * h * (1 + s / (6 * h)) + 6 * B * s * h * V


def achieved(m: Machine, w: Workload, lay: Layout, seconds: float) -> dict:
    """FLOP/s per rank at this step time, and its fraction of the machine's peak (as papers report)."""
    per_rank = model_flops_per_step(w) / seconds / lay.ranks
    return {"flops_per_rank": per_rank, "fraction_of_peak": per_rank / (m.peak_flops or m.gemm_flops)}


def activation_bytes_per_layer(m: Machine, w: Workload, lay: Layout) -> float:
    s, b, h, a, t = w.seq, lay.micro_batch, w.n_embd, w.n_head, lay.tp
    if m.activations == "korthikanti":
        if lay.sp or t == 1:
            return s * b * h * (34 + 5 * a * s / h) / t
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    rep, par = (2, 18) if lay.sp and t > 1 else (4, 16)
    return 4 * (s * b * h * (rep + par / t) + a * s * s * b / t)


def memory_per_rank(m: Machine, w: Workload, lay: Layout) -> dict:
    """Bytes per rank: model state and activations (the first pipeline stage, which holds the most)."""
    params_rank = w.params / (lay.tp * lay.pp)
    weights_grads = params_rank * 8 if m.state_bytes_per_param >= 16 else params_rank * 4
    optimizer = params_rank * (m.state_bytes_per_param - (8 if m.state_bytes_per_param >= 16 else 4))
    if lay.zero:
        optimizer /= lay.dp
    layers = math.ceil(w.n_layer / lay.pp)
    in_flight = min(lay.pp, max(1, w.global_batch // (lay.dp * lay.micro_batch)))
    per_layer = activation_bytes_per_layer(m, w, lay)
    if lay.recompute:
        layer_inputs = w.seq * lay.micro_batch * w.n_embd * m.bytes_per_value / (lay.tp if lay.sp else 1)
        acts = in_flight * layers * layer_inputs + per_layer
    else:
        acts = in_flight * layers * per_layer
    logits = lay.micro_batch * w.seq * w.vocab / lay.tp * 4 * 2          # logits and softmax, float32
    total = weights_grads + optimizer + acts + logits
    return {"total": total, "weights_grads": weights_grads, "optimizer": optimizer, "activations": acts,
            "logits": logits}


# Presets for common nodes. Sustained rates are what real training reaches, not datasheet
# peaks; each field says where its number comes from.
PRESETS = {
    "dgx-2h": Machine(
        name="dgx-2h", ranks_per_node=16, gemm_flops=90e12, peak_flops=125e12, elem_rate=115e9, mem_bw=800e9, mem_bytes=32e9,
        intra_alpha=10e-6, intra_bw=120e9, inter_alpha=20e-6, inter_bw=12.5e9, bytes_per_value=2,
        opt_traffic_per_param=28, state_bytes_per_param=18, ew_rep=40, ew_par=60, ew_att=10,
        activations="korthikanti",
        source="16x V100 32 GB (SXM3, 450 W) per node, NVSwitch; V100 datasheet: 125 TFLOP/s fp16 tensor "
               "peak, 900 GB/s HBM2, NVLink 300 GB/s bidirectional; NCCL all-reduce bus bandwidth on "
               "NVSwitch ~120 GB/s; 8x 100 Gb/s InfiniBand per node (12.5 GB/s per GPU pair share "
               "assumed); Megatron-LM (arXiv 1909.08053) sustains 39 TFLOP/s per GPU end to end; "
               "elementwise rate and counts: see docs/costmodel.md (calibrated on the paper's 1-GPU point)"),
    "dgx-a100": Machine(
        name="dgx-a100", ranks_per_node=8, gemm_flops=230e12, peak_flops=312e12, elem_rate=400e9, mem_bw=1.6e12, mem_bytes=80e9,
        intra_alpha=8e-6, intra_bw=230e9, inter_alpha=10e-6, inter_bw=23e9, bytes_per_value=2,
        opt_traffic_per_param=28, state_bytes_per_param=18, ew_rep=20, ew_par=30, ew_att=6,
        activations="korthikanti",
        source="8x A100 80 GB per node, NVSwitch (NVLink3 600 GB/s bidirectional); A100 datasheet: "
               "312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e; NCCL all-reduce bus bandwidth ~230 GB/s in-node; "
               "8x 200 Gb/s HDR InfiniBand per node (25 GB/s per GPU); Narayanan et al. 2021 (arXiv "
               "2104.04473) report 135-163 TFLOP/s per GPU end to end; fused kernels assumed (smaller "
               "elementwise counts than dgx-2h)"),
    "dgx-h100": Machine(
        name="dgx-h100", ranks_per_node=8, gemm_flops=600e12, peak_flops=989e12, elem_rate=900e9, mem_bw=3.0e12, mem_bytes=80e9,
        intra_alpha=6e-6, intra_bw=360e9, inter_alpha=8e-6, inter_bw=45e9, bytes_per_value=2,
        opt_traffic_per_param=28, state_bytes_per_param=18, ew_rep=20, ew_par=30, ew_att=6,
        activations="korthikanti",
        source="8x H100 SXM 80 GB per node, NVSwitch (NVLink4 900 GB/s bidirectional); H100 datasheet: "
               "989 TFLOP/s bf16 dense, 3.35 TB/s HBM3; NCCL all-reduce bus bandwidth ~360 GB/s in-node; "
               "8x 400 Gb/s NDR InfiniBand per node (50 GB/s per GPU); sustained GEMM ~60% of peak"),
}


def machine(name_or_path: str) -> Machine:
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    try:
        return Machine.load(name_or_path)
    except FileNotFoundError:
        raise UserError(f"unknown machine {name_or_path!r}: use one of {', '.join(PRESETS)} or a JSON "
                         "file from `mpi-tp calibrate`") from None
