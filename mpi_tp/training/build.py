"""Setting up a training run on every rank: data, output folder, layout, model, optimizer, starting point.

Every step that can fail on bad input runs under `collective_setup`, so a
missing file or a layout that does not fit is one message from rank 0 and exit
status 2 on every rank, before any training collective starts.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass

from mpi4py import MPI

from mpi_tp import checkpoint as ckpt_io
from mpi_tp.core import backend
from mpi_tp.core.errors import UserError, refuse_to_replace
from mpi_tp.core.params import widen_grads
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.pipeline.stage import PipelineStage
from mpi_tp.parallel.topology import Topology
from mpi_tp.text.tokenizer import of_token_file
from mpi_tp.training import run_dir
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.config_sources import batch_split
from mpi_tp.training.data import (
    BatchSampler,
    Corpus,
    DataError,
    eval_batches,
    load_corpus,
    split,
)
from mpi_tp.training.loss_scale import LossScaler
from mpi_tp.training.optim import SGD, AdamW


@dataclass
class Run:
    """Everything a training run holds on one rank."""

    cfg: TrainConfig
    comm: MPI.Comm
    topo: Topology
    model: GPT | PipelineStage
    opt: AdamW | SGD
    reducer: GradReducer
    corpus: Corpus
    sampler: BatchSampler        # batch(step) of the global batch: a pure function of (seed, step)
    val_batches: list
    val_tokens: object
    out: str                     # the run folder (rank 0 writes it)
    rows: slice                  # this replica's rows of the global batch (its micro-batches, one after another)
    first: int                   # the first step to run (1, or the checkpoint's step + 1)
    lock: run_dir.RunLock | None = None    # rank 0's hold on `out` (mpi_tp.training.run_dir)
    tokenizer: object = None     # what the data's ids are (saved with each checkpoint); None: unknown,
    no_tokenizer: str = ""       # and why
    scaler: LossScaler | None = None       # fp16's dynamic loss scale (mpi_tp.training.loss_scale)

    def close(self) -> None:
        """Give the run folder back (rank 0 removes its lock); the run may still be read."""
        if self.lock is not None:
            self.lock.release()

    @property
    def ckpt_root(self) -> str:
        return os.path.join(self.out, "checkpoints")

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.micro_batches * self.topo.dp.size * self.cfg.block_size



def _load_data(cfg: TrainConfig, comm):
    if cfg.data == "shakespeare":   # one download: rank 0 fetches into the cache, then everyone reads it
        collective_setup(lambda: load_corpus(cfg.data) if comm.Get_rank() == 0 else None, comm=comm)
    corpus = load_corpus(cfg.data)
    V = cfg.vocab_size or corpus.vocab_size      # the model's (a Hugging Face folder's, with --init-from)
    top = int(corpus.data.max()) if corpus.vocab_size > V else 0      # (one pass over the data)
    if top >= V:
        raise DataError(f"--data {cfg.data} holds ids of a vocabulary of {corpus.vocab_size} (up to "
                        f"{top}), but the model's has {V} tokens: train it on data of its own "
                        "tokenizer")
    train_tokens, val_tokens = split(corpus, cfg.val_fraction)
    global_batch = cfg.batch_size * cfg.micro_batches * cfg.dp
    sampler = BatchSampler(train_tokens, cfg.block_size, global_batch, cfg.seed)
    val = eval_batches(val_tokens, cfg.block_size, global_batch, cfg.eval_batches, cfg.seed + 1)   # any layout's
    return corpus, sampler, val, val_tokens


def _claim_out_dir(cfg: TrainConfig, comm):
    """Rank 0 claims the run folder (mpi_tp.training.run_dir: a run of its own, locked for this job); every
    rank gets its path, rank 0 also the lock and what to say about it."""
    claimed, failure = None, None
    if comm.Get_rank() == 0:
        try:
            refuse_to_replace(cfg.trace, cfg.overwrite, "--trace")
            claimed = run_dir.claim(cfg.out, cfg.resume, cfg.overwrite)
        except UserError as e:
            failure = e                   # raised after the broadcast, which every rank must reach
    out = comm.bcast(claimed[0] if claimed else None)
    if failure is not None:
        raise failure
    return out, (claimed[1] if claimed else None), (claimed[2] if claimed else [])


def _find_start(cfg: TrainConfig, out: str):
    """The checkpoint to continue from (--resume: the run's own newest; --init-from: the one named, or a
    Hugging Face folder), or None."""
    if cfg.init_from:
        return ckpt_io.open_checkpoint(cfg.init_from)
    root = os.path.join(out, "checkpoints")
    if cfg.resume and ckpt_io.complete_steps(root):
        return ckpt_io.Checkpoint(root)
    return None


UNCOMPARED = ("out", "resume", "overwrite", "init_from", "trace")     # where and how, not what


def changed_options(start, cfg: TrainConfig) -> list[str]:
    """The training options a resumed run changes against its checkpoint ('steps 20 -> 40'), for the log: any
    but the model (checkpoint.check_model_config), the data and the optimizer (_restore) may change."""
    saved, mine = start.meta.get("train_config", {}), cfg.to_dict()
    return [f"{k} {saved[k]} -> {mine[k]}" for k in mine if k in saved and k not in UNCOMPARED and saved[k] != mine[k]]


def batch_note(start, cfg: TrainConfig, topo) -> str:
    """What a resume did with the global batch (config_sources.keep_global_batch keeps it unless told)."""
    saved = batch_split(start.meta)
    if not cfg.resume or saved is None:
        return ""
    mine = (topo.dp.size, cfg.micro_batches, cfg.batch_size)
    before, now = math.prod(saved), math.prod(mine)
    if before != now:
        return (f"; the global batch changes from {before} to {now} sequences (--batch-size given): the steps from "
                "here draw other batches than the saved run would have")
    if saved != mine:
        return f"; the global batch of {now} sequences kept (dp x micro-batches x batch-size)"
    return ""


def _restore(start, model, opt, cfg: TrainConfig, corpus, scaler=None) -> int:
    """Load a checkpoint into model and optimizer (load_into refuses another model: check_model_config);
    returns the step it was saved at. One without optimizer state (a Hugging Face folder, an import) leaves
    the optimizer fresh."""
    if cfg.resume and start.meta.get("data", {}).get("sha256") not in (None, corpus.sha256):
        raise ckpt_io.CheckpointError(f"checkpoint {start.dir} was trained on other data (sha256 "
                                      f"{start.meta['data']['sha256'][:12]}, now {corpus.sha256[:12]}): "
                                      "resume with the same --data, or use --init-from to fine-tune")
    saved_opt = start.meta.get("train_config", {}).get("optimizer", cfg.optimizer)
    if saved_opt != cfg.optimizer:
        raise ckpt_io.CheckpointError(f"checkpoint {start.dir} holds {saved_opt} state but this run uses "
                                      f"--optimizer {cfg.optimizer}")
    if cfg.precision != "fp32" and start.meta.get("dtypes") == "float64":
        raise ckpt_io.CheckpointError(
            f"--init-from {start.dir} holds a float64 model, and --precision {cfg.precision} starts from float32 "
            "or 16-bit weights: continue it with --precision fp32 --dtype float64, or write it as float32 first "
            "(mpi-tp export CHECKPOINT DIR --format hf, then mpi-tp import-hf DIR OUT --dtype float32) and start "
            "from OUT")
    ckpt_io.load_into(start, model, opt)        # no optimizer state saved: fresh moments, masters = the weights
    ckpt_io.restore_rng(start, model)
    if scaler is not None and cfg.resume and "loss_scale" in start.meta:
        scaler.restore(start.meta["loss_scale"])        # a resumed fp16 run scales as the straight one
    return start.step


def build(cfg: TrainConfig, comm=MPI.COMM_WORLD) -> Run:
    """Validate, load the data, lay out the ranks, build the model and optimizer, and restore a checkpoint."""
    collective_setup(cfg.validate, comm.Get_size(), comm=comm)
    backend.use(cfg.backend, comm)              # collective itself: one message on every rank if a GPU fails
    corpus, sampler, val_batches, val_tokens = collective_setup(_load_data, cfg, comm, comm=comm)
    out, lock, notes = collective_setup(_claim_out_dir, cfg, comm, comm=comm)
    for note in notes:
        rank0_print(note, comm=comm)
    try:
        return _build(cfg, comm, corpus, sampler, val_batches, val_tokens, out, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def build_in_scratch(cfg: TrainConfig, comm=MPI.COMM_WORLD, prefix: str = "mpi-tp-") -> Run:
    """build() in a temporary run folder, removed at once: for the commands that run steps but keep no run
    (explain's step lesson, verify). The run may be stepped; it has no folder to write into."""
    cfg.out = comm.bcast(tempfile.mkdtemp(prefix=prefix) if comm.Get_rank() == 0 else None)
    try:
        run = build(cfg, comm)
        run.close()
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(cfg.out, ignore_errors=True)
    return run


def _build(cfg: TrainConfig, comm, corpus, sampler, val_batches, val_tokens, out, lock) -> Run:
    topo = Topology.create(comm, layout=cfg.layout(comm.Get_size()))
    if topo.pp.size > 1 or cfg.virtual_stages > 1:     # this rank's stage of the pipeline: its chunks of the model
        model = build_stage(cfg.model_config(corpus.vocab_size), topo, cfg.model_dtype, cfg.seed, cfg.sequence_parallel, cfg.schedule,
                            cfg.micro_batches, cfg.virtual_stages, cfg.recompute,
                            cfg.first_stage_layers or None, cfg.last_stage_layers or None)
    else:
        model = GPT(cfg.model_config(corpus.vocab_size), topo, dtype=cfg.model_dtype, seed=cfg.seed,
                    sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute)
    if cfg.fp32_grads:
        widen_grads(model.parameters())
    # the reducer moves the gradients (and, for the distributed optimizer, the parameters) into buckets:
    # before the optimizer reads them
    reducer = GradReducer(model, topo.dpcp, cfg.bucket_mb, cfg.overlap_dp, cfg.dp_allreduce == "hierarchical",
                          distributed=bool(cfg.zero), stage=max(cfg.zero, 1))
    per_replica = cfg.batch_size * cfg.micro_batches
    rows = topo.replica_rows(per_replica)
    opt = cfg.make_optimizer(model.parameters(), reducer)   # --zero 1-3: distributed over the reducer's buckets
    scaler = cfg.loss_scaler()
    start = collective_setup(_find_start, cfg, out, comm=comm)
    first = 1
    if start is not None:
        with start:
            first = collective_setup(_restore, start, model, opt, cfg, corpus, scaler, comm=comm) + 1
        changed = changed_options(start, cfg) if cfg.resume else []
        rank0_print(f"continuing from {start.dir} (step {first - 1})" +
                    (f"; changed since: {', '.join(changed)}" if changed else "") + batch_note(start, cfg, topo),
                    comm=comm)
    tokenizer, why = of_token_file(corpus.tokenizer)       # (every rank: the same file, the same answer)
    if corpus.tokenizer is None and model.cfg.vocab_size != 256:
        tokenizer, why = None, (f"the model's vocabulary has {model.cfg.vocab_size} tokens, not the 256 bytes, "
                                "and the data names no tokenizer")
    return Run(cfg, comm, topo, model, opt, reducer, corpus, sampler, val_batches, val_tokens, out, rows, first,
               lock, tokenizer, why, scaler)
