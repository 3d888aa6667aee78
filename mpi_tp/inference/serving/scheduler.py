"""Rank 0's scheduler: admission, batching and cancellation, on the one thread that calls MPI.

HTTP threads `submit` checked requests as Jobs, one per choice (n choices of
each prompt: a row each, with its own seed), together into a bounded queue
("full" past --max-queue: the client gets 429 with Retry-After), or refused
while stopping. The scheduler's loop then runs one decode step per iteration:

1. every running row gets its next token from the last logits (rank 0 samples
   it: generate.Row; the log-probabilities too, if its request asked), which
   goes to its Job's items for the HTTP thread to send; a row that is done (max_tokens, a stop sequence, an error in its
   sampling) or whose client went away (Job.cancelled) leaves the batch;
2. waiting Jobs join in the freed rows: at every step ("continuous", the
   default: a request's prefill runs beside the others' decoding, and nobody
   waits for the longest request of a batch to end), or only when no row
   runs ("static": the batch runs until its longest request ends). When
   nothing runs, the first request waits up to --batch-wait-ms for company;
3. the step goes out as one command (protocol.py) and every rank applies it.

Nothing here raises between two collectives: a request's failure on rank 0
(its sampling) ends that request with an error and the batch goes on.
SIGTERM / SIGINT: no new requests (503), the queued ones answered 503, the
running rows finished, then "stop" to every rank.
"""
from __future__ import annotations

import collections
import itertools
import queue
import sys
import threading
import time
from typing import NamedTuple

from mpi_tp.inference.decode import compaction
from mpi_tp.inference.generate import Row, step_command
from mpi_tp.inference.sampling import log_probabilities
from mpi_tp.inference.serving.protocol import Batch, broadcast_command

DONE, CLOSED = "done", "closed"        # a job's last item: generated in full / shut down before it began


def log(message: str) -> None:
    print(f"mpi-tp serve: {message}", file=sys.stderr, flush=True)


class Token(NamedTuple):
    """A choice's next token, for its HTTP thread: its text (UTF-8 bytes, maybe b"" while a character waits for
    its other half), its id, and (logprobs asked) its log-probability and the likeliest tokens' (id, value)."""
    piece: bytes
    id: int
    logprob: float | None = None
    top: list | None = None


class Failed(NamedTuple):
    """A choice that failed on rank 0 (its sampling raised): why."""
    message: str


class Job:
    """One choice of a request, between its HTTP thread and the scheduler. A request's choices share one queue
    of (index, item): each token (a Token), then DONE, Failed or CLOSED."""

    def __init__(self, request, index: int = 0, items: queue.SimpleQueue | None = None, timeout: float = 0.0,
                 logprobs: int | None = None):
        self.request, self.index, self.timeout, self.logprobs = request, index, timeout, logprobs
        self.items = items or queue.SimpleQueue()
        self.ended_by = None                  # set by the HTTP thread: "client" (gone), "deadline" or "error"
        self.arrived, self.last = time.monotonic(), None

    def put(self, item) -> None:
        self.items.put((self.index, item))

    def cancel(self, why: str) -> None:
        """Nobody will read this job any more: its row leaves the batch at the next decode step."""
        self.ended_by = why

    @property
    def cancelled(self) -> bool:
        return self.ended_by is not None

    def count_end(self, metrics) -> None:
        """The scheduler frees a cancelled job's row: counted as cancelled when its client went away (a
        deadline is counted where it is said, as deadlines_total; a failure as its answer's status)."""
        if self.ended_by == "client":
            metrics.count("cancelled")


class ServedRow(Row):
    def __init__(self, ident, job: Job, tokenizer):
        super().__init__(ident, job.request, tokenizer)
        self.job, self.token = job, None

    def take(self, logits) -> int:
        """As Row.take; the token (its logprobs too, if the request asked) kept for the HTTP thread."""
        token = super().take(logits)
        if token >= 0:
            k = self.job.logprobs
            try:
                self.token = Token(self.piece, token, *(log_probabilities(logits, token, k) if k is not None else ()))
            except Exception as e:  # noqa: BLE001 (rank 0 alone: this request's failure, as Row.take's)
                self.error = f"{type(e).__name__}: {e}"
                return -1
        return token

    @property
    def done(self) -> bool:
        return self.job.cancelled or super().done


class Scheduler:
    """Rank 0: the queue of checked requests, the running rows, and the loop that steps them."""

    def __init__(self, model, comm, metrics, stop, max_batch: int = 8, max_queue: int = 64,
                 batching: str = "continuous", batch_wait_ms: float = 20.0, tokenizer=None):
        self.comm, self.metrics, self.stop, self.tokenizer = comm, metrics, stop, tokenizer
        self.max_batch, self.max_queue, self.batching, self.wait = max_batch, max_queue, batching, batch_wait_ms / 1e3
        self.batch, self.rows, self.ids = Batch(model, max_batch), [], itertools.count()
        self.waiting, self.cond = collections.deque(), threading.Condition()
        self.accepting, self.active = True, 0          # active: requests whose HTTP thread has not finished
        self.stats = {"requests_served": 0, "steps": 0, "largest_batch": 0}

    # ------------------------------------------------------------- HTTP threads

    def submit(self, jobs: list[Job]) -> str:
        """A request's jobs (its choices) queued together: 'queued', 'full' (they would pass --max-queue) or
        'stopping'."""
        with self.cond:
            if not self.accepting or self.stop.requested:
                return "stopping"
            free = max(0, self.max_batch - len(self.rows))      # jobs that join at the next step do not queue
            if len(self.waiting) + len(jobs) > self.max_queue + free:
                return "full"
            self.waiting.extend(jobs)
            self.active += 1
            self.cond.notify_all()
            return "queued"

    def finished(self) -> None:
        """A submitted request's HTTP thread is done with it (answered, or its client left)."""
        with self.cond:
            self.active -= 1
            self.cond.notify_all()

    def gauges(self) -> dict:
        return {"queue_depth": len(self.waiting), "running_rows": len(self.rows)}

    # ------------------------------------------------------------- the MPI thread

    def run(self) -> None:
        """Steps until a signal and the end of the running rows; then "stop" to every rank."""
        logits = None
        while True:
            if self.stop.requested and self.accepting:
                self._close()
            cmd = self._step(logits)
            if cmd is None:
                if not self.accepting:
                    break
                continue
            cmd = broadcast_command(self.comm, cmd, idle=self.batch.rows == 0)
            logits = self.batch.apply(cmd)
            self.stats["steps"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], self.batch.rows)
        broadcast_command(self.comm, {"cmd": "stop"}, idle=True)
        with self.cond:                       # the last answers written before the process ends
            self.cond.wait_for(lambda: self.active == 0, timeout=10)

    def _step(self, logits) -> dict | None:
        """This step's command, or None when no row runs and none joins."""
        for row in self.rows:
            if row.job.cancelled:
                row.job.count_end(self.metrics)
        cmd = step_command(self.rows, logits)              # each row's token; those done leave
        now, ended = time.monotonic(), []
        for row, token in zip(self.rows, cmd["tokens"]):
            job = row.job
            if token >= 0:
                self.metrics.token(job.last is None, now - (job.last or job.arrived))
                job.last = now
                job.put(row.token)
            if row.done and not job.cancelled:
                ended.append((job, Failed(row.error) if row.error else DONE))
                self.stats["requests_served"] += row.error is None and job.index == 0   # (once a request)
        self.rows = [self.rows[i] for i in compaction(len(self.rows), cmd["leave"])]
        for job, last in ended:                            # after the rows are updated: a client that
            job.put(last)                                  # reads /metrics next sees its row gone
        joins = [ServedRow(next(self.ids), job, self.tokenizer) for job in self._admit(self.max_batch - len(self.rows),
                                                                       bool(self.rows))]
        if not cmd["tokens"] and not joins:
            return None
        cmd["join"] = step_command([], None, joins)["join"]
        self.rows += joins
        return cmd

    def _admit(self, free: int, running: bool) -> list[Job]:
        """Jobs to join now, at most `free`. While nothing runs: wait (0.1 s at a time, to see a
        signal) for a first one, then up to batch_wait for company."""
        with self.cond:
            if not self.accepting or (running and self.batching == "static"):
                return []
            if not running:
                if not self.waiting:
                    self.cond.wait(0.1)
                deadline = time.monotonic() + self.wait        # (a signal ends the wait: they run, then stop)
                while (self.waiting and len(self.waiting) < free and time.monotonic() < deadline
                       and not self.stop.requested):
                    self.cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            jobs = []
            while self.waiting and len(jobs) < free:
                job = self.waiting.popleft()
                if job.cancelled:                        # its client left (or its deadline passed) while it waited
                    job.count_end(self.metrics)
                else:
                    jobs.append(job)
            return jobs

    def _close(self) -> None:
        log(f"{self.stop.requested}: stopping (no new requests; the queued ones answered 503, the "
            f"{len(self.rows)} running finished)")
        with self.cond:
            self.accepting = False
            while self.waiting:
                self.waiting.popleft().put(CLOSED)
