"""What the cost model knows of a machine: a `Machine`'s rates, links and memory, and presets with sources.

A Machine comes from a preset (`dgx-2h`, `dgx-a100`, `dgx-h100`: datasheet and
published figures, each named in its `source`) or from `mpi-tp calibrate`
(measured on the machine you are on, written as JSON).
"""
from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from mpi_tp.core.errors import UserError
from mpi_tp.core.precision import precision


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
    ew_rep: float = 40.0           # elementwise elements per S B C per layer not split by TP
    ew_par: float = 60.0           # ... split by TP
    ew_att: float = 10.0           # ... per H S^2 B (softmax and friends), split by TP
    activations: str = "mpi_tp"    # "mpi_tp" (our count, float32) or "korthikanti" (16-bit Megatron)
    peak_flops: float = 0.0        # the datasheet peak per rank that papers quote fractions of (0: gemm_flops)
    flash_flops: float = 0.0       # FlashAttention's sustained FLOP/s (forward and backward; 0: the GEMM rate)
    # [[positions, FLOP/s], ...]: FlashAttention's rate (forward and backward) on that many query positions
    # against as many keys (a rank's S, or a ring step's S / Z block); replaces flash_flops when given, read as
    # gemm_curve is (empty: constant)
    flash_curve: list = field(default_factory=list)
    # [[rows, FLOP/s], ...]: the GEMM rate measured with that many rows (the B S tokens of a
    # micro-batch); when given it replaces gemm_flops, interpolated in log(rows) (empty: constant)
    gemm_curve: list = field(default_factory=list)
    layer_overhead: float = 0.0    # seconds per layer and micro-batch (forward + backward) not
    #                                proportional to the work: kernel launches, the interpreter
    dp_overlap: float = 0.0        # fraction of a concurrent data-parallel all-reduce that compute
    #                                hides (0: none, as measured on one CPU core per rank; 1: fully)
    pp_overlap: float = 0.0        # fraction of a stage-to-stage transfer that the receive posted ahead
    #                                hides behind the receiver's compute in the steady state (0: none,
    #                                as measured here: docs/parallelism.md; the fill and drain never hide)
    # [[buffer bytes n, seconds], ...]: the timed all-reduces that alpha and the bandwidth were fitted
    # to (calibrate; empty for presets): t = 2 (T-1) alpha + 2 (T-1)/T n beta, beta = 1 / bandwidth
    allreduce_points: list = field(default_factory=list)
    source: str = ""

    @classmethod
    def load(cls, path: str) -> Machine:
        if os.path.isdir(path):
            raise UserError(f"--machine {path!r} is a folder: give a preset ({', '.join(PRESETS)}) or the JSON "
                            "file `mpi-tp calibrate` writes")
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise UserError(f"machine file {path!r} is not JSON ({e}): write it with `mpi-tp calibrate`") from None
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise UserError(f"machine file {path!r} cannot be read ({e.strerror or e})") from None
        if not isinstance(data, dict):
            raise UserError(f"machine file {path!r} must hold a JSON object of the Machine's fields (as `mpi-tp "
                            "calibrate` writes it)")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UserError(f"machine file {path!r}: unknown keys {sorted(unknown)}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise UserError(f"machine file {path!r} lacks {', '.join(missing)}: write it with `mpi-tp calibrate`, "
                            "or copy a preset's fields (docs/costmodel.md)")
        bad = [k for k in required if k != "name" and (k == "ranks_per_node" and not isinstance(data[k], int)) or k != "name" and (not isinstance(data[k], (int, float)) or isinstance(data[k], bool)
                                                       or data[k] <= 0) and k not in ("intra_alpha", "inter_alpha")]
        bad += [k for k in ("intra_alpha", "inter_alpha") if not isinstance(data[k], (int, float)) or data[k] < 0]
        if bad:
            raise UserError(f"machine file {path!r}: {', '.join(bad)} must be positive numbers (alphas: >= 0)")
        m = cls(**data)
        for key, x in (("gemm_curve", "rows"), ("flash_curve", "positions")):
            if not all(isinstance(pt, list) and len(pt) == 2 and min(pt) > 0 for pt in getattr(m, key)):
                raise UserError(f"machine file {path!r}: {key} must be [[{x}, FLOP/s], ...] with positive "
                                "numbers")
        return m

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)


# Presets for common nodes. Sustained rates are what real training reaches, not datasheet
# peaks; each field says where its number comes from. dp_overlap = 1: NCCL runs the gradient
# all-reduce on its own stream while the backward pass computes; the Megatron-LM README (2022)
# says the data-parallel all-reduce "can almost entirely be eliminated by overlapping" it with
# back-propagation. No GEMM curve or per-layer overhead: constant rates (see docs/costmodel.md).
PRESETS = {
    "dgx-2h": Machine(
        name="dgx-2h", ranks_per_node=16, gemm_flops=90e12, peak_flops=125e12, elem_rate=115e9, mem_bw=800e9, mem_bytes=32e9,
        intra_alpha=10e-6, intra_bw=120e9, inter_alpha=20e-6, inter_bw=12.5e9, bytes_per_value=2,
        opt_traffic_per_param=28, state_bytes_per_param=18, ew_rep=40, ew_par=60, ew_att=10,
        activations="korthikanti", dp_overlap=1.0,
        source="16x V100 32 GB (SXM3, 450 W) per node, NVSwitch; V100 datasheet: 125 TFLOP/s fp16 tensor "
               "peak, 900 GB/s HBM2, NVLink 300 GB/s bidirectional; NCCL all-reduce bus bandwidth on "
               "NVSwitch ~120 GB/s; 8x 100 Gb/s InfiniBand per node (12.5 GB/s per GPU pair share "
               "assumed); Megatron-LM (arXiv 1909.08053) sustains 39 TFLOP/s per GPU end to end; "
               "elementwise rate and counts: see docs/costmodel.md (calibrated on the paper's 1-GPU point)"),
    "dgx-a100": Machine(
        name="dgx-a100", ranks_per_node=8, gemm_flops=230e12, peak_flops=312e12, elem_rate=400e9, mem_bw=1.6e12, mem_bytes=80e9,
        intra_alpha=8e-6, intra_bw=230e9, inter_alpha=10e-6, inter_bw=23e9, bytes_per_value=2,
        opt_traffic_per_param=28, state_bytes_per_param=18, ew_rep=20, ew_par=30, ew_att=6,
        activations="korthikanti", dp_overlap=1.0,
        source="8x A100 80 GB per node, NVSwitch (NVLink3 600 GB/s bidirectional); A100 datasheet: "
               "312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e; NCCL all-reduce bus bandwidth ~230 GB/s in-node; "
               "8x 200 Gb/s HDR InfiniBand per node (25 GB/s per GPU); Narayanan et al. 2021 (arXiv "
               "2104.04473) report 135-163 TFLOP/s per GPU end to end; fused kernels assumed (smaller "
               "elementwise counts than dgx-2h)"),
    "dgx-h100": Machine(
        name="dgx-h100", ranks_per_node=8, gemm_flops=600e12, peak_flops=989e12, flash_flops=326e12,
        flash_curve=[[512, 207e12], [1024, 260e12], [2048, 293e12], [4096, 312e12], [8192, 322e12],
                     [16384, 326e12]], elem_rate=900e9, mem_bw=3.0e12, mem_bytes=80e9,
        intra_alpha=6e-6, intra_bw=360e9, inter_alpha=8e-6, inter_bw=45e9, bytes_per_value=2,
        opt_traffic_per_param=28, state_bytes_per_param=18, ew_rep=20, ew_par=30, ew_att=6,
        activations="korthikanti", dp_overlap=1.0,
        source="8x H100 SXM 80 GB per node, NVSwitch (NVLink4 900 GB/s bidirectional); H100 datasheet: "
               "989 TFLOP/s bf16 dense, 3.35 TB/s HBM3; NCCL all-reduce bus bandwidth ~360 GB/s in-node; "
               "8x 400 Gb/s NDR InfiniBand per node (50 GB/s per GPU); sustained GEMM ~60% of peak; "
               "FlashAttention-2 at head size 128 on an H100 SXM5 (Shah et al. 2024, arXiv 2407.08608, figures "
               "5 and 6: forward with the causal mask 191, 260, 298, 319, 333, 335 TFLOP/s and backward 214, "
               "260, 291, 310, 318, 322 at 512 ... 16K positions), a step's 1 forward and 2.5 backwards "
               "together, 3.5 / (1 / fwd + 2.5 / bwd): flash_curve (flash_flops its last point)"),
}


def curve_rate(points: list, x: float, flat: float) -> float:
    """A measured rate at x: the [[x, FLOP/s], ...] points interpolated in log(x), flat beyond their ends;
    `flat` without points."""
    if not points:
        return flat
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, f0), (x1, f1) in itertools.pairwise(points):
        if x <= x1:
            return f0 + math.log(x / x0) / math.log(x1 / x0) * (f1 - f0)
    return points[-1][1]


def machine(name_or_path: str) -> Machine:
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    try:
        return Machine.load(name_or_path)
    except FileNotFoundError:
        raise UserError(f"unknown machine {name_or_path!r}: use one of {', '.join(PRESETS)} or a JSON "
                         "file from `mpi-tp calibrate`") from None


def state_bytes(m: Machine) -> dict:
    """Bytes per parameter of the model state by kind: weights at the machine's bytes per value, fp32
    masters for 16-bit weights, AdamW's two moments (fp32, or the weights' wider format), the gradients
    what state_bytes_per_param leaves (the weights' width for mpi_tp; 4 for the presets' Megatron)."""
    v = m.bytes_per_value
    master, moments = (4 if v < 4 else 0), 2 * max(v, 4)
    return {"weights": v, "grads": m.state_bytes_per_param - v - master - moments, "master": master,
            "moments": moments}


def with_precision(m: Machine, name: str, grad_bytes: int | None = None) -> Machine:
    """m training at --precision `name` as mpi_tp does: values of that width, the state of
    mpi_tp.planning.memory's table. grad_bytes: the gradients' width when it differs from the weights'
    (4: reduced in fp32, Megatron's accumulate-in-fp32; the hook for bf16 gradients reduced in fp32)."""
    v = precision(name).bytes_per_value
    state = 2 * v + (4 if v < 4 else 0) + 2 * max(v, 4) + ((grad_bytes or v) - v)
    return replace(m, bytes_per_value=v, state_bytes_per_param=state)
