"""The training loop: a byte-level GPT trained with tensor parallelism over all ranks.

    mpiexec -n 2 mpi-tp train                      # defaults: Python's docs, ~3 minutes on 2 cores
    mpiexec -n 4 mpi-tp train --n-embd 256 --steps 2000 --data shakespeare

Every rank builds its shards of the same model and draws the same batch (the
sampler is a pure function of seed and step), so no data is communicated. Rank
0 prints progress and writes the run folder:

    config.json      the resolved configuration
    metrics.jsonl    one JSON object per logged step and per validation estimate
    run.json         summary: data hash, layout, final losses, timings, communication, sample
    checkpoints/     sharded HDF5 checkpoints (mpi_tp.checkpoint), every --save-every steps and at the end

`--resume` continues the run in --out from its newest checkpoint, bitwise as if
it had never stopped: the weights, AdamW moments and step count come from the
checkpoint, the batches and dropout masks are pure functions of (seed, step).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import signal
import time

import numpy
from mpi4py import MPI

from mpi_tp import __version__
from mpi_tp import checkpoint as ckpt_io
from mpi_tp.core import backend
from mpi_tp.core.failpoints import armed
from mpi_tp.core.runtime import UsageError, collective_setup, rank0_print
from mpi_tp.inference.sampling import printable, sample
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.data import BatchSampler, eval_batches, load_corpus, split, unigram_entropy
from mpi_tp.training.faults import Preemption
from mpi_tp.training.optim import SGD, AdamW, clip_coefficient, grad_norm, lr_at


def _load_data(cfg: TrainConfig, comm):
    if cfg.data == "shakespeare":   # one download: rank 0 fetches into the cache, then everyone reads it
        collective_setup(lambda: load_corpus(cfg.data) if comm.Get_rank() == 0 else None, comm=comm)
    corpus = load_corpus(cfg.data)
    train_tokens, val_tokens = split(corpus, cfg.val_fraction)
    sampler = BatchSampler(train_tokens, cfg.block_size, cfg.batch_size * cfg.dp, cfg.seed)   # global batch
    val = eval_batches(val_tokens, cfg.block_size, cfg.batch_size, cfg.eval_batches, cfg.seed + 1)
    return corpus, sampler, val, val_tokens


def _make_out_dir(cfg: TrainConfig, comm) -> str:
    out = cfg.out
    if not out:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") if comm.Get_rank() == 0 else None
        out = os.path.join("runs", comm.bcast(stamp))
    if comm.Get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(f"output folder {out!r} is not writable; pass --out DIR")
    return out


def _find_start(cfg: TrainConfig, out: str):
    """The checkpoint to continue from (--resume: the run's own newest; --init-from: the one named), or None."""
    if cfg.init_from:
        return ckpt_io.Checkpoint(cfg.init_from)
    root = os.path.join(out, "checkpoints")
    if cfg.resume and ckpt_io.complete_steps(root):
        return ckpt_io.Checkpoint(root)
    return None


def _restore(start, model, opt, cfg: TrainConfig, corpus) -> int:
    """Load a checkpoint into model and optimizer; returns the step it was saved at."""
    if cfg.resume and start.meta.get("data", {}).get("sha256") not in (None, corpus.sha256):
        raise ckpt_io.CheckpointError(f"checkpoint {start.dir} was trained on other data (sha256 "
                                      f"{start.meta['data']['sha256'][:12]}, now {corpus.sha256[:12]}): "
                                      "resume with the same --data, or use --init-from to fine-tune")
    saved_opt = start.meta.get("train_config", {}).get("optimizer", cfg.optimizer)
    if saved_opt != cfg.optimizer:
        raise ckpt_io.CheckpointError(f"checkpoint {start.dir} holds {saved_opt} state but this run uses "
                                      f"--optimizer {cfg.optimizer}")
    ckpt_io.load_into(start, model, opt)
    ckpt_io.restore_rng(start, model)
    return start.step


def evaluate(model: GPT, batches) -> float:
    """Mean loss over fixed batches, without dropout."""
    was_training = model.dropout.training
    model.eval()
    loss = sum(model.forward(x, y) for x, y in batches) / len(batches)
    model.train(was_training)
    return loss


def environment(comm) -> dict:
    return {"mpi_tp": __version__, "python": platform.python_version(), "numpy": numpy.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(), "world_size": comm.Get_size(),
            "backend": backend.name(), "host": platform.node(), "machine": platform.machine()}


def _fmt_time(s: float) -> str:
    return f"{int(s // 60)}:{int(s % 60):02d}"


def train(cfg: TrainConfig, comm=MPI.COMM_WORLD) -> dict:
    """Train as configured; returns the run summary (on every rank)."""
    collective_setup(cfg.validate, comm.Get_size(), comm=comm)
    collective_setup(backend.use, cfg.backend, comm, comm=comm)
    corpus, sampler, val_batches, val_tokens = collective_setup(_load_data, cfg, comm, comm=comm)
    out = collective_setup(_make_out_dir, cfg, comm, comm=comm)
    tp, dp = cfg.layout(comm.Get_size())
    topo = Topology.create(comm, tp=tp, dp=dp)
    model = GPT(cfg.model_config(), topo, dtype=cfg.dtype, seed=cfg.seed, sequence_parallel=cfg.sequence_parallel)
    params = model.parameters()
    reducer = GradReducer(model, topo.dp, cfg.bucket_mb, cfg.overlap_dp, cfg.dp_allreduce == "hierarchical")   # before the optimizer reads grads
    mine = slice(topo.dp.rank * cfg.batch_size, (topo.dp.rank + 1) * cfg.batch_size)   # this replica's rows
    model.dropout.row0 = mine.start
    if cfg.optimizer == "adamw":
        opt = AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                    zero_group=topo.dp if cfg.zero else None)
    else:
        opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                  zero_group=topo.dp if cfg.zero else None)

    start = collective_setup(_find_start, cfg, out, comm=comm)
    first = 1
    if start is not None:
        with start:
            first = collective_setup(_restore, start, model, opt, cfg, corpus, comm=comm) + 1
        rank0_print(f"continuing from {start.dir} (step {first - 1})", comm=comm)
    ckpt_root = os.path.join(out, "checkpoints")

    def save(step):
        meta = {"config": model.cfg.to_dict(), "train_config": cfg.to_dict(), "optimizer_t": opt.t,
                "rng": ckpt_io.rng_state(model),
                "data": {"name": corpus.name, "sha256": corpus.sha256, "position": step,
                         "sampler": "batch(step) is a pure function of (seed, step)"}}
        t = time.perf_counter()
        path = ckpt_io.save(ckpt_root, step, model, opt, meta, keep=cfg.keep)
        rank0_print(f"saved {path} in {time.perf_counter() - t:.2f} s", comm=comm)

    is_root = comm.Get_rank() == 0
    entropy = unigram_entropy(val_tokens)
    record = {"config": cfg.to_dict(), "out": out, "layout": topo.describe(),
              "data": {"name": corpus.name, "source": corpus.source, "sha256": corpus.sha256,
                       "bytes": int(corpus.data.size)},
              "model": {"parameters": model.num_params(), **model.cfg.to_dict()},
              "environment": environment(comm)}
    metrics = None
    if is_root:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg.to_dict(), f, indent=2)
        metrics = open(os.path.join(out, "metrics.jsonl"), "a" if first > 1 else "w")
    rank0_print(f"mpi_tp {__version__}: {model.num_params():,} parameters, tp={topo.tp.size} x dp={topo.dp.size}"
                f"{' +sp' if cfg.sequence_parallel else ''}{' +zero1' if cfg.zero else ''}, "
                f"{cfg.dtype} on {backend.name()}; data {corpus.name} ({corpus.data.size:,} bytes, "
                f"sha256 {corpus.sha256[:12]}); unigram entropy {entropy:.3f} nats/byte; out {out}",
                comm=comm)

    def log(entry):
        if metrics is not None:
            metrics.write(json.dumps(entry) + "\n")
            metrics.flush()

    tokens_per_step = cfg.batch_size * dp * cfg.block_size
    t0 = t_log = time.perf_counter()
    comm_log = topo.stats.total_seconds()
    losses, val_loss, skipped = [], float("nan"), 0
    preemption = Preemption(comm)
    for step in range(first, cfg.steps + 1):
        lr = lr_at(step - 1, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
        x, y = sampler.batch(step - 1)
        model.zero_grad()
        loss = model.forward(x[mine], y[mine])
        if dp > 1:                        # the global batch's loss: the mean over replicas
            loss_buf = numpy.array([loss])
            loss = float(topo.dp.all_reduce(loss_buf)[0]) / dp
        norm = float("nan")
        if math.isfinite(loss):
            model.backward(reducer=reducer)
            if armed("nan-grad", step):
                params[0].grad[...] = float("nan")
            norm = grad_norm(params, topo.tp)
        if not (math.isfinite(loss) and math.isfinite(norm)):   # the same on every rank: all act together
            what = f"the loss became {loss}" if not math.isfinite(loss) else f"the gradient norm became {norm}"
            skipped += 1
            if cfg.on_nonfinite == "stop" or skipped > 10:
                raise UsageError(f"{what} at step {step}; stopped without saving (the last checkpoint is "
                                 f"untouched). Lower --lr (now {cfg.lr}), raise --warmup, or pass "
                                 "--on-nonfinite skip", status=3)
            rank0_print(f"step {step}: {what}; step skipped ({skipped} in a row)", comm=comm)
            log({"step": step, "skipped": what})
            continue
        skipped = 0
        opt.step(lr, grad_scale=clip_coefficient(norm, cfg.grad_clip))    # clipping inside the update
        losses.append(loss)
        if armed("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)

        if step % cfg.eval_every == 0 or step == cfg.steps:
            val_loss = evaluate(model, val_batches)
            log({"step": step, "val_loss": val_loss})
        if step % cfg.log_every == 0 or step == cfg.steps:
            now = time.perf_counter()
            n = min((step - 1) % cfg.log_every + 1, len(losses))
            comm_s = topo.stats.total_seconds() - comm_log
            entry = {"step": step, "loss": sum(losses[-n:]) / n, "lr": lr, "grad_norm": norm,
                     "step_s": (now - t_log) / n, "tokens_per_s": n * tokens_per_step / (now - t_log),
                     "comm_s": comm_s, "elapsed_s": now - t0}
            log(entry)
            left = (now - t0) / (step - first + 1) * (cfg.steps - step)
            rank0_print(f"step {step:>{len(str(cfg.steps))}}/{cfg.steps} | loss {entry['loss']:.4f} | "
                        f"val {'-' if math.isnan(val_loss) else f'{val_loss:.4f}'} | lr {lr:.2e} | {entry['tokens_per_s']:,.0f} tok/s | "
                        f"comm {100 * comm_s / (now - t_log):.0f}% | {_fmt_time(now - t0)} elapsed, "
                        f"{_fmt_time(left)} left", comm=comm)
            t_log, comm_log = now, topo.stats.total_seconds()
        if preemption.agreed():          # SIGTERM on any rank: save, then leave cleanly
            save(step)
            rank0_print(f"SIGTERM received: saved step {step}; continue with --resume --out {out}", comm=comm)
            record["preempted_at"] = step
            break
        if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            save(step)
    preemption.close()

    train_s = time.perf_counter() - t0
    if "preempted_at" not in record:       # a pre-empted run leaves its summary and sample to the resumed one
        tail = losses[-cfg.log_every:] or [float("nan")]
        record.update({"steps": cfg.steps, "first_step": first, "final_train_loss": sum(tail) / len(tail),
                       "final_val_loss": val_loss,
                       "unigram_entropy": entropy, "train_seconds": train_s,
                       "tokens_per_s": len(losses) * tokens_per_step / train_s,
                       "communication": topo.stats.snapshot()})
        rank0_print(f"done in {_fmt_time(train_s)}: validation loss {val_loss:.4f} nats/byte "
                    f"(unigram entropy {entropy:.4f}), {record['tokens_per_s']:,.0f} tok/s", comm=comm)
        if cfg.sample_len:
            text = sample(model, cfg.prompt.encode(), cfg.sample_len, cfg.temperature, seed=cfg.seed)
            record["sample"] = printable(text)
            rank0_print("--- sample ---\n" + record["sample"] + "\n--------------", comm=comm)
    if is_root:
        metrics.close()
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump(record, f, indent=2)
    return record
