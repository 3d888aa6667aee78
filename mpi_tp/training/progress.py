"""What a training run reports: progress lines, metrics.jsonl and run.json, written by rank 0.

    config.json      the resolved configuration
    metrics.jsonl    one JSON object per logged step, per validation estimate and per skipped step
    run.json         summary: data hash, layout, final losses, timings, communication, memory per
                     rank (held_memory), sample

comm_s (metrics.jsonl, and the progress line's `comm` share of the window's wall time): the
seconds rank 0 was held in communication since the line before (CommStats: the intervals never
overlap, so the share is at most 100%). run.json's communication: the counters by phase
(mpi_tp.training.loop.communication; README, "Training").

A mixture-of-experts run's logged steps also hold (MoEMeter) cross_entropy, aux_loss and
z_loss, means over the same steps as `loss`, which is the loss trained on and printed:
cross_entropy + moe_aux_weight * aux_loss + moe_z_weight * z_loss (aux_loss and z_loss
unweighted, summed over the MoE blocks); and `moe`, per MoE block the routing of the
logged step's global batch (every micro-batch of every replica): tokens_per_expert (the
assignments each expert computed, after the capacity), imbalance (max / mean of those)
and dropped (assignments past the capacity); tokens and drops add up to B S k per block,
B the global batch. The progress line adds the cross-entropy, the worst block's imbalance
and the share of assignments dropped. Dense runs log and print what they did before.

A resumed run continues metrics.jsonl from its checkpoint: lines of steps after
the checkpoint (logged before a crash, then run again) are cut first, so every
step appears once.
"""
from __future__ import annotations

import json
import math
import os
import platform
import resource
import time

import numpy

from mpi_tp import __version__
from mpi_tp.core import backend, runtime
from mpi_tp.core.blas import which as gemm_library
from mpi_tp.core.mpi_library import library_version


def held_memory(model, opt, comm) -> dict:
    """Memory per rank, in MiB, every rank's (collective): the model state this rank holds (weights,
    gradients and optimizer state: each buffer once, the buckets they are views of counted whole) and
    the process's peak resident size (on GPUs the host side only)."""
    def root(a):
        while getattr(a, "base", None) is not None:
            a = a.base
        return a
    params = model.unique_parameters()
    buckets = [b for b in getattr(getattr(opt, "reducer", None), "buckets", []) if b.grad_share is not None]
    kinds = {"weights": [p.data for p in params] + [b.param_share for b in buckets],      # ZeRO: the shares too
             "gradients": [p.grad for p in params if p.grad is not None] + [b.grad_share for b in buckets],
             "optimizer": [a for arrays in getattr(opt, "state", {}).values() for a in arrays]}
    seen, mine = set(), {}
    for kind, arrays in kinds.items():
        bases = [root(a) for a in arrays]
        mine[kind] = sum(b.nbytes for b in {id(b): b for b in bases if id(b) not in seen}.values()) / 2**20
        seen.update(id(b) for b in bases)
    mine["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024       # KiB on Linux
    every = numpy.empty((comm.Get_size(), len(mine)))  # four floats per rank, once, at the end (no pickle)
    comm.Allgather(numpy.array(list(mine.values())), every)
    return {k: every[:, j].tolist() for j, k in enumerate(mine)}


def environment(comm) -> dict:
    return {"mpi_tp": __version__, "python": platform.python_version(), "numpy": numpy.__version__,
            "mpi": library_version(), "world_size": comm.Get_size(),
            "backend": backend.name(), "host": platform.node(), "machine": platform.machine(),
            "gemm": gemm_library(), "malloc": runtime.MALLOC}


def fmt_time(s: float) -> str:
    return f"{int(s // 60)}:{int(s % 60):02d}"


def cut_metrics(path: str, last_step: int) -> int:
    """Keep the lines of metrics.jsonl whose step is at most last_step (atomically); returns lines dropped.

    A line that does not parse (a crash in the middle of a write) is dropped too.
    """
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                keep = json.loads(line).get("step", 0) <= last_step
            except (ValueError, AttributeError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


class Progress:
    """Rank 0's reports of one run; on other ranks every method does nothing but keep the time."""

    def __init__(self, run):
        self.run, self.is_root = run, run.comm.Get_rank() == 0
        cfg = run.cfg
        self.metrics = None
        self.t0 = self.t_log = time.perf_counter()
        self.comm_log = run.topo.stats.total_seconds()
        if self.is_root:
            with open(os.path.join(run.out, "config.json"), "w") as f:
                json.dump(cfg.to_dict(), f, indent=2)
            path = os.path.join(run.out, "metrics.jsonl")
            if run.first > 1:
                cut_metrics(path, run.first - 1)
            self.metrics = open(path, "a" if run.first > 1 else "w")

    def say(self, text: str) -> None:
        if self.is_root:
            print(text, flush=True)

    def log(self, entry: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(entry) + "\n")
            self.metrics.flush()

    def step_line(self, step: int, losses: list, lr: float, norm: float, val_loss: float,
                  moe: dict | None = None, scaling: dict | None = None) -> None:
        """Log the mean loss since the last line and print the progress line (moe: MoEMeter.report();
        scaling: fp16's LossScaler.state())."""
        cfg, now = self.run.cfg, time.perf_counter()
        n = min((step - 1) % cfg.log_every + 1, len(losses))
        comm_s = self.run.topo.stats.total_seconds() - self.comm_log
        span = now - self.t_log
        entry = {"step": step, "loss": sum(losses[-n:]) / n if n else float("nan"), "lr": lr, "grad_norm": norm,
                 "step_s": span / max(n, 1), "tokens_per_s": n * self.run.tokens_per_step / span,
                 "comm_s": comm_s, "elapsed_s": now - self.t0}
        experts = ""
        if scaling is not None:
            entry.update(loss_scale=scaling["scale"], overflows=scaling["overflows"])
        if moe is not None:
            entry.update(moe)
            assigned = sum(sum(m["tokens_per_expert"]) + m["dropped"] for m in moe["moe"])
            dropped = sum(m["dropped"] for m in moe["moe"])
            experts = (f"ce {moe['cross_entropy']:.4f} | imbalance {max(m['imbalance'] for m in moe['moe']):.2f}, "
                       f"dropped {100 * dropped / max(assigned, 1):.1f}% | ")
        self.log(entry)
        left = (now - self.t0) / (step - self.run.first + 1) * (cfg.steps - step)
        val = "-" if math.isnan(val_loss) else f"{val_loss:.4f}"
        self.say(f"step {step:>{len(str(cfg.steps))}}/{cfg.steps} | loss {entry['loss']:.4f} | {experts}val {val} | "
                 f"lr {lr:.2e} | {entry['tokens_per_s']:,.0f} tok/s | comm {100 * comm_s / span:.0f}% | "
                 f"{fmt_time(now - self.t0)} elapsed, {fmt_time(left)} left")
        self.t_log, self.comm_log = now, self.run.topo.stats.total_seconds()

    def close(self, record: dict | None) -> None:
        """Close metrics.jsonl and write run.json (record None: leave the run.json there is)."""
        if not self.is_root:
            return
        self.metrics.close()
        if record is not None:
            with open(os.path.join(self.run.out, "run.json"), "w") as f:
                json.dump(record, f, indent=2)


class MoEMeter:
    """The mixture-of-experts metrics of a run, on every rank (see the module docstring).

    Per micro-batch `add` takes the model's moe_stats() into the step being run (a pipeline stage
    adds each of its chunks': every block has a row, filled by the stage that holds it, and the
    cross-entropy comes from the last stage); `commit` keeps a finished step (a skipped one is left
    out, as from the loss); `report`, at a logged step and on every rank (a collective), sums this
    replica's numbers over the data-parallel group and the pipeline's stages (small all-reduces: 3
    floats and (E + 1) integers per MoE block, exact in float64) and starts afresh.
    """

    def __init__(self, model, dp, pp=None):
        self.dp, self.pp, self.E = dp, pp, model.cfg.moe_experts
        self.blocks = [i for i in range(model.cfg.n_layer) if model.cfg.is_moe_block(i)]
        self.parts = numpy.zeros(3)                                   # cross-entropy, aux, z: summed over steps
        self.steps = 0
        self._parts, self._counts = numpy.zeros(3), numpy.zeros((len(self.blocks), self.E + 1))
        self.counts = self._counts.copy()                             # the last committed step's routing

    def begin(self) -> None:
        self._parts[:] = 0
        self._counts[:] = 0

    def add(self, model, weight: float) -> None:
        """After a micro-batch's forward: its loss parts (times weight: 1 / micro-batches) and routing."""
        s = model.moe_stats()
        ce = s["cross_entropy"] if model.last else 0.0
        self._parts += weight * numpy.array([ce, s["aux_loss"], s["z_loss"]], dtype=float)
        for layer in s["layers"]:
            row = self._counts[self.blocks.index(layer["block"])]
            row[:self.E] += backend.asnumpy(layer["tokens_per_expert"])
            row[self.E] += layer["dropped"]

    def commit(self) -> None:
        self.parts += self._parts
        self.steps += 1
        self.counts = self._counts.copy()

    def report(self) -> dict:
        """The logged entry's MoE fields, the same on every rank; then a new window begins."""
        buf = numpy.concatenate([self.parts, self.counts.reshape(-1)])
        for group in (self.dp, self.pp):
            if group is not None and group.size > 1:
                buf = group.all_reduce(buf)
        ce, aux, z = buf[:3] / (max(self.steps, 1) * self.dp.size)
        layers = []
        for block, row in zip(self.blocks, buf[3:].reshape(len(self.blocks), self.E + 1)):
            tokens = [int(round(t)) for t in row[:self.E]]
            mean = sum(tokens) / self.E
            layers.append({"block": block, "tokens_per_expert": tokens, "dropped": int(round(row[self.E])),
                           "imbalance": max(tokens) / mean if mean else float("nan")})
        self.parts[:] = 0
        self.steps = 0
        return {"cross_entropy": float(ce), "aux_loss": float(aux), "z_loss": float(z), "moe": layers}
