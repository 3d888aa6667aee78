"""What rank 0 tells the other ranks while serving, and what every rank then does with it.

Rank 0 alone talks to clients and samples; every rank computes. So once per
decode step rank 0 broadcasts one command, and every rank applies it to its
`Batch` (the running rows of one Decoder) in the same order:

    {"cmd": "step",
     "tokens": [t_0, ..., t_{A-1}],    the token rank 0 chose for each running row (-1: none)
     "leave": [i, ...],                rows that are done: finished, cancelled or failed
     "join":  [[id, [ids]], ...],      new requests and their prompts' token ids
     "errors": {id: message}}          requests that failed on rank 0 (they are in "leave")
    {"cmd": "stop"}

Applying it: the leaving rows go (the last rows take their slots:
decode.compaction), every remaining row steps with its token, the joining rows
are prefilled after them; the logits of every running row come back on every
rank, in row order, for rank 0's next choice. A command is JSON (no pickle):
its length in one broadcast, its bytes in a second. While no row runs, the
ranks wait in a polled non-blocking broadcast (sleeping between polls) rather
than spin; while rows run, in a blocking one (no added latency per step).
Every rank knows which it is: both follow from the commands so far.
"""
from __future__ import annotations

import json
import time

import numpy

from mpi_tp.inference.decode import Decoder


def broadcast_command(comm, command: dict | None = None, idle: bool = False) -> dict:
    """Rank 0's command on every rank (rank 0 too). idle: every rank waits in a polled Ibcast."""
    data = json.dumps(command).encode() if comm.Get_rank() == 0 else b""
    n = numpy.array([len(data)], dtype=numpy.int64)
    if idle:
        req = comm.Ibcast(n, root=0)
        while not req.Test():          # an idle rank sleeps here instead of spinning in MPI's progress loop
            time.sleep(0.002)
    else:
        comm.Bcast(n, root=0)
    buf = numpy.frombuffer(data, dtype=numpy.uint8).copy() if data else numpy.empty(int(n[0]), numpy.uint8)
    comm.Bcast(buf, root=0)
    return json.loads(buf.tobytes())


class Batch:
    """Every rank: the running rows (ids, in row order) of one Decoder, moved by rank 0's commands."""

    def __init__(self, model, slots: int):
        self.decoder, self.ids = Decoder(model, slots), []

    @property
    def rows(self) -> int:
        return len(self.ids)

    def apply(self, cmd: dict, on_token=None) -> numpy.ndarray:
        """Run one step command: (rows, V) logits of the running rows after it, on every rank.
        on_token(id, token), if given, is called for each chosen token, leaving rows' included."""
        chosen = cmd["tokens"]
        if len(chosen) != self.rows:
            raise ValueError(f"a command with {len(chosen)} tokens for {self.rows} running rows")
        if on_token is not None:
            for ident, token in zip(self.ids, chosen):
                if token >= 0:
                    on_token(ident, token)
        order = self.decoder.leave(cmd["leave"]) if cmd["leave"] else list(range(self.rows))
        self.ids = [self.ids[i] for i in order]
        parts = [self.decoder.step([chosen[i] for i in order])] if order else []
        if cmd["join"]:
            parts.append(self.decoder.join([p for _, p in cmd["join"]]))
            self.ids += [ident for ident, _ in cmd["join"]]
        return numpy.concatenate(parts) if parts else numpy.zeros((0, 0))


def follow(model, comm, slots: int) -> None:
    """Ranks other than 0: apply each command rank 0 broadcasts, until it says stop."""
    batch = Batch(model, slots)
    while (cmd := broadcast_command(comm, idle=batch.rows == 0))["cmd"] != "stop":
        batch.apply(cmd)
