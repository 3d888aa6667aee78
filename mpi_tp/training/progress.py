"""What a training run reports: progress lines, metrics.jsonl and run.json, written by rank 0.

    config.json      the resolved configuration
    metrics.jsonl    one JSON object per logged step, per validation estimate and per skipped step
    run.json         summary: data hash, layout, final losses, timings, communication, sample

A resumed run continues metrics.jsonl from its checkpoint: lines of steps after
the checkpoint (logged before a crash, then run again) are cut first, so every
step appears once.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time

import numpy
from mpi4py import MPI

from mpi_tp import __version__
from mpi_tp.core import backend


def environment(comm) -> dict:
    return {"mpi_tp": __version__, "python": platform.python_version(), "numpy": numpy.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(), "world_size": comm.Get_size(),
            "backend": backend.name(), "host": platform.node(), "machine": platform.machine()}


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

    def step_line(self, step: int, losses: list, lr: float, norm: float, val_loss: float) -> None:
        """Log the mean loss since the last line and print the progress line."""
        cfg, now = self.run.cfg, time.perf_counter()
        n = min((step - 1) % cfg.log_every + 1, len(losses))
        comm_s = self.run.topo.stats.total_seconds() - self.comm_log
        span = now - self.t_log
        entry = {"step": step, "loss": sum(losses[-n:]) / n if n else float("nan"), "lr": lr, "grad_norm": norm,
                 "step_s": span / max(n, 1), "tokens_per_s": n * self.run.tokens_per_step / span,
                 "comm_s": comm_s, "elapsed_s": now - self.t0}
        self.log(entry)
        left = (now - self.t0) / (step - self.run.first + 1) * (cfg.steps - step)
        val = "-" if math.isnan(val_loss) else f"{val_loss:.4f}"
        self.say(f"step {step:>{len(str(cfg.steps))}}/{cfg.steps} | loss {entry['loss']:.4f} | val {val} | "
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
