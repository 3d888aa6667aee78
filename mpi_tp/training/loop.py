"""The training loop: a byte-level GPT trained with tensor (x data) parallelism over all ranks.

    mpiexec -n 2 mpi-tp train                      # defaults: Python's docs, ~3 minutes on 2 cores
    mpiexec -n 4 mpi-tp train --n-embd 256 --steps 2000 --data shakespeare

Every rank builds its shards of the same model (`build`) and draws the same
global batch (the sampler is a pure function of seed and step), so no data is
communicated. Each step is forward, backward (with the data-parallel gradient
all-reduces), a check for non-finite numbers, and the optimizer update; then
the ranks agree on pre-emption and save when it is time. Rank 0 reports
(`progress`) and the run folder holds checkpoints/ (sharded HDF5, every
--save-every steps and at the end).

`--resume` continues the run in --out from its newest checkpoint, bitwise as if
it had never stopped: the weights, AdamW moments and step count come from the
checkpoint, the batches and dropout masks are pure functions of (seed, step).
"""
from __future__ import annotations

import os
import signal
import time

import numpy
from mpi4py import MPI

from mpi_tp import __version__
from mpi_tp import checkpoint as ckpt_io
from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.core.failpoints import armed
from mpi_tp.inference.sampling import printable, sample
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.comm_stats import OTHER
from mpi_tp.parallel.pipeline.stage import micro_batch_rows
from mpi_tp.parallel.trace import Trace, span
from mpi_tp.training.build import Run, build
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.data import unigram_entropy
from mpi_tp.training.faults import Preemption
from mpi_tp.training.loss_scale import Overflow
from mpi_tp.training.optim import lr_at
from mpi_tp.training.progress import (
    MoEMeter,
    Progress,
    environment,
    fmt_time,
    held_memory,
)
from mpi_tp.training.step import train_step

TRAIN_STEPS = "train_steps"
PHASES = (TRAIN_STEPS, "evaluation", "checkpoints", OTHER)


def evaluate(model: GPT, batches, rows: slice, micro_batches: int = 1) -> float:
    """Mean loss over the fixed validation batches, without dropout. Each batch is a global batch: this
    replica takes its rows, in the training step's micro-batches, and the replicas' means are averaged, so
    every layout evaluates the same sequences (and each replica a D-th of them)."""
    was_training = model.dropout.training
    model.eval()
    parts = micro_batch_rows(rows, micro_batches)
    loss = numpy.array([sum(model.forward(x[p], y[p]) for x, y in batches for p in parts)
                        / (len(batches) * len(parts))])
    model.train(was_training)
    dp = model.topo.dp
    if dp.size > 1:
        dp.all_reduce(loss)
        loss /= dp.size
    return float(loss[0])


def run_step(run: Run, step: int, lr: float, meter: MoEMeter | None = None) -> tuple[float, float, str | None]:
    """The library step (mpi_tp.training.step) on the global batch of `step`: (loss, gradient norm, problem)."""
    x, y = run.sampler.batch(step - 1)
    return train_step(run.model, run.opt, x, y, run.rows, run.cfg.micro_batches, lr, run.cfg.grad_clip,
                        run.reducer, meter, step, run.scaler)


def save(run: Run, step: int, progress: Progress) -> None:
    """A checkpoint of this step (collective over every rank)."""
    meta = {"config": run.model.cfg.to_dict(), "train_config": run.cfg.to_dict(), "optimizer_t": run.opt.t,
            "rng": ckpt_io.rng_state(run.model), **({"loss_scale": run.scaler.state()} if run.scaler else {}),
            "data": {"name": run.corpus.name, "sha256": run.corpus.sha256, "position": step,
                     "sampler": "batch(step) is a pure function of (seed, step)"}}
    t = time.perf_counter()
    with run.topo.stats.in_phase("checkpoints"):
        path = ckpt_io.save(run.ckpt_root, step, run.model, run.opt, meta, keep=run.cfg.keep, tokenizer=run.tokenizer)
    progress.say(f"saved {path} in {time.perf_counter() - t:.2f} s")


def train(cfg: TrainConfig, comm=MPI.COMM_WORLD) -> dict:
    """Train as configured; returns the run summary (on every rank). The run folder is this job's from
    build() until the end, whatever happens (mpi_tp.training.run_dir)."""
    run = build(cfg, comm)
    try:
        return _train(run, cfg, comm)
    finally:
        run.close()


def _train(run: Run, cfg: TrainConfig, comm) -> dict:
    model, topo, corpus = run.model, run.topo, run.corpus
    entropy = unigram_entropy(run.val_tokens)
    record = {"config": cfg.to_dict(), "out": run.out, "layout": topo.layout.to_dict(),
              "data": {"name": corpus.name, "source": corpus.source, "sha256": corpus.sha256,
                       "tokens": int(corpus.data.size), **({"bytes": int(corpus.data.size)} if corpus.unit == "byte" else {}),
                       "vocab_size": corpus.vocab_size, "tokenizer": corpus.tokenizer or {"kind": "bytes"}},
              "model": {"parameters": model.num_params(), **model.cfg.to_dict()},
              "environment": environment(comm)}
    progress = Progress(run)
    if run.first > cfg.steps:            # resumed after the last step: the run is complete already
        progress.say(f"nothing to do: the checkpoint is at step {run.first - 1} and --steps is {cfg.steps}; "
                     "raise --steps to train further")
        progress.close(None)
        return {**record, "steps": cfg.steps, "first_step": run.first}
    moe = model.cfg.moe_experts > 0
    meter = MoEMeter(model, topo.dp, topo.pp) if moe else None
    pipeline = f" ({cfg.schedule}, M={cfg.micro_batches})" if topo.pp.size > 1 else ""
    shared = f" + {cfg.moe_shared_experts} shared" if cfg.moe_shared_experts else ""
    experts = (f" (MoE: {cfg.moe_experts} experts{shared}, top-{cfg.moe_top_k} by {cfg.moe_router}, every "
               f"{cfg.moe_every} block(s), capacity {cfg.moe_capacity or 'none'})") if moe else ""
    mc = model.cfg
    arch = (f" (llama: {mc.n_head} heads, {mc.kv_heads} key/value, MLP {mc.ffn}, "
            f"{'tied' if mc.tied else 'untied'} output layer)") if mc.llama else ""
    progress.say(f"mpi_tp {__version__}: {model.num_params():,} parameters{arch}, layout {topo.layout.describe()}"
                 f"{pipeline}{experts}, {precision_text(cfg)} on {backend.name()}; data {corpus.name} "
                 f"({corpus.data.size:,} {corpus.unit}s, sha256 {corpus.sha256[:12]}); unigram entropy {entropy:.3f} "
                 f"nats/{corpus.unit}; out {run.out}")

    losses, val_loss, skipped = [], float("nan"), 0
    if cfg.trace:
        topo.stats.trace = Trace(comm)
    preemption = Preemption(comm)
    try:
        for step in range(run.first, cfg.steps + 1):
            lr = lr_at(step - 1, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
            with topo.stats.in_phase(TRAIN_STEPS):
                loss, norm, problem = run_step(run, step, lr, meter)
            if problem is None:
                skipped = 0
                losses.append(loss)
            elif isinstance(problem, Overflow):     # fp16: the scale backs off, the next step tries again
                progress.say(f"step {step}: {problem}; step skipped")
                progress.log({"step": step, "skipped": problem, "loss": loss, "loss_scale": run.scaler.scale})
            else:                         # the same on every rank: all act together
                skipped += 1
                if cfg.on_nonfinite == "stop" or skipped > 10:
                    raise UserError(f"{problem} at step {step}; stopped without saving (the last checkpoint "
                                    f"is untouched). Lower --lr (now {cfg.lr}), raise --warmup, or pass "
                                    "--on-nonfinite skip", status=3)
                progress.say(f"step {step}: {problem}; step skipped ({skipped} in a row)")
                progress.log({"step": step, "skipped": problem})
            if armed("sigterm", step):
                os.kill(os.getpid(), signal.SIGTERM)
            last = step == cfg.steps
            if step % cfg.eval_every == 0 or last:
                with span(topo.stats.trace, "evaluate", "compute", step=step), topo.stats.in_phase("evaluation"):
                    val_loss = evaluate(model, run.val_batches, run.rows, cfg.micro_batches)
                progress.log({"step": step, "val_loss": val_loss})
            if problem is None and (step % cfg.log_every == 0 or last):
                progress.step_line(step, losses, lr, norm, val_loss, meter.report() if meter else None,
                                   run.scaler.state() if run.scaler else None)
            stop = preemption.agreed()    # SIGTERM / SIGUSR1 on any rank: save, then leave cleanly (collective)
            if last or stop or (cfg.save_every and step % cfg.save_every == 0):
                save(run, step, progress)
            if stop and not last:          # at the last step the run is simply complete
                progress.say(f"{stop} received: saved step {step}; continue with --resume --out {run.out}")
                record["preempted_at"] = step
                progress.close(record)    # the resumed run writes the summary and the sample
                return record
    finally:
        preemption.close()
        if topo.stats.trace is not None:  # also after a pre-emption or a stop: what happened up to there
            topo.stats.trace.write(cfg.trace, comm)
            progress.say(f"trace of every rank written to {cfg.trace} (open it in Perfetto or chrome://tracing)")

    train_s = time.perf_counter() - progress.t0
    tail = losses[-cfg.log_every:] or [float("nan")]
    record.update({"steps": cfg.steps, "first_step": run.first, "final_train_loss": sum(tail) / len(tail),
                   "final_val_loss": val_loss, "unigram_entropy": entropy, "train_seconds": train_s,
                   "tokens_per_s": len(losses) * run.tokens_per_step / train_s,
                   "communication": communication(topo.stats, cfg.steps - run.first + 1),
                   "memory_mib": held_memory(model, run.opt, comm),
                   **({"loss_scale": run.scaler.state()} if run.scaler else {})})
    mem = record["memory_mib"]
    state = max(mem["weights"][r] + mem["gradients"][r] + mem["optimizer"][r] for r in range(comm.Get_size()))
    progress.say(f"done in {fmt_time(train_s)}: validation loss {val_loss:.4f} nats/{corpus.unit} "
                 f"(unigram entropy {entropy:.4f}), {record['tokens_per_s']:,.0f} tok/s")
    progress.say(f"memory per rank: at most {state:,.1f} MiB of model state (weights, gradients, optimizer), "
                 f"{max(mem['peak_rss']):,.0f} MiB resident at peak")
    if cfg.sample_len:
        record["sample"] = final_sample(run, cfg)
        progress.say("--- sample ---\n" + record["sample"] + "\n--------------")
    progress.close(record)
    return record


def communication(stats, steps_run: int) -> dict:
    """run.json's "communication": the counters by phase (README, "run.json"): train_steps, every step this
    process ran (forward, backward, gradient reductions, the optimizer's gathers): divided by steps_run,
    one step's; evaluation, checkpoints, and other (setup, the logged steps' reports): once per run or
    per estimate, save or log line, not per step."""
    phases = stats.phases()
    return {"steps_run": steps_run, **{name: phases.get(name, {}) for name in PHASES}}


def precision_text(cfg: TrainConfig) -> str:
    """The start-up line's number format: 'float32', 'bf16 (fp32 masters)', 'fp16 (fp32 masters, loss scale 65536)'."""
    grads = ", fp32 gradients" if cfg.fp32_grads else ""
    scaling = f", loss scale {cfg.initial_loss_scale:g}" if cfg.precision == "fp16" else ""
    return cfg.dtype if cfg.precision == "fp32" else f"{cfg.precision} (fp32 masters{grads}{scaling})"


def final_sample(run, cfg: TrainConfig) -> str:
    """The end-of-run sample, as text: bytes, or the token file's tokenizer's ids decoded by it."""
    tok, model = run.tokenizer, run.model
    if tok is None:
        return f"(no sample: {run.no_tokenizer})"
    if run.topo.cp.size > 1:
        return "(no sample under context parallelism: mpi-tp generate --checkpoint OUT/checkpoints)"
    ids = sample(model, tok.encode(cfg.prompt), cfg.sample_len, cfg.temperature, seed=cfg.seed)
    return printable(tok.decode(ids).encode() if tok.kind != "bytes" else bytes(ids))