"""Context parallelism measured: activation memory per rank and step time against S, at cp 1, 2 and 4, and the
share of the ring's communication that the attention computed meanwhile hides.

    for n in 1 2 4; do mpiexec -n $n python -m mpi4py experiments/memory/context_parallel.py; done
    python experiments/memory/context_parallel.py --draw          # the figure, from the JSON lines

A GPT of C 128, 4 heads, 2 blocks, vocabulary 256, batch 1, float32, no dropout, at cp = the world size
(tp = dp = 1). For each S: one warm-up step, then 3 timed training steps (forward, backward, the
reducer's gradient all-reduce over cp; no optimizer): the median step time (the slowest rank's), the
activations the blocks keep after a forward (their caches: Block.activation_bytes, the largest rank),
and the ring's waits (cp/ring_wait: the time a rank sat blocked on the ring's messages). The same
messages sent alone (the 3Z - 2 per layer of ring_attention's closed form, each K and V of this rank's
S_r positions, around the same ring with nothing to compute) give the ring's bare communication time;
hidden = 1 - waits / bare. A budget of 1 GiB of activations per rank stands in for a device's memory:
at cp 1 the sizes past it are not run (the formula's bytes are recorded as "does not fit"). cp 4 runs
4 ranks on this machine's 2 cores (oversubscribed: its times are labelled so, its memory is not
affected). One JSON line per (cp, S) in experiments/memory/results/context_parallel.jsonl, with the machine and
the command; --draw writes docs/figures/context_parallel.png.
"""
import json
import os
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "results", "context_parallel.jsonl")
FIG = os.path.join(HERE, "..", "..", "docs", "figures", "context_parallel.png")
C, H, L, B = 128, 4, 2, 1
SIZES = (512, 1024, 2048, 4096, 8192)
BUDGET = 2**30


def measure(comm):
    from mpi4py import MPI

    from mpi_tp.core.runtime import machine_text
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.model.gpt import GPT
    from mpi_tp.parallel.context_parallel import ContextSplit
    from mpi_tp.parallel.data_parallel import GradReducer
    from mpi_tp.parallel.finalize import finalize_grads
    from mpi_tp.parallel.topology import Topology
    from mpi_tp.planning.activations import activation_bytes_per_layer
    N = comm.Get_size()
    for S in SIZES:
        formula = L * activation_bytes_per_layer(S / N, B, C, H, 1, recompute="selective" if N > 1 else "none")
        row = {"cp": N, "S": S, "machine": machine_text(), "oversubscribed": N > os.cpu_count(),
               "command": f"mpiexec -n {N} python -m mpi4py experiments/memory/context_parallel.py",
               "formula_activation_bytes": formula}
        if formula > BUDGET:
            row["fits"] = False
            _write(comm, row)
            continue
        topo = Topology.create(comm, tp=1, cp=N)
        model = GPT(GPTConfig(vocab_size=256, block_size=S, n_layer=L, n_head=H, n_embd=C), topo, seed=0)
        reducer = GradReducer(model, topo.dpcp, overlap=True)
        x = numpy.random.default_rng(0).integers(0, 256, (B, S + 1))
        times, waits, acts = [], [], 0
        for i in range(4):
            topo.stats.reset()
            comm.Barrier()
            t0 = time.perf_counter()
            model.zero_grad()
            model.forward(x[:, :-1], x[:, 1:])
            acts = max(acts, sum(b.activation_bytes() for b in model.h))
            model.backward(reducer=reducer)
            finalize_grads(model, reducer)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i:
                times.append(dt)
                waits.append(topo.stats.snapshot().get("cp/ring_wait", {}).get("seconds", 0.0))
        split = ContextSplit(topo.cp, S)
        bare = _bare_ring(topo, split, N) if N > 1 else 0.0
        wait = comm.allreduce(float(numpy.median(waits)), op=MPI.MAX)
        step = float(numpy.median(times))
        alone = _without_ring_messages(comm, topo, model, reducer, x) if N > 1 else step
        row.update(fits=True, step_s=step, activation_bytes=comm.allreduce(acts, op=MPI.MAX), ring_wait_s=wait,
                   ring_bare_s=bare, step_without_ring_messages_s=alone,
                   hidden=(1 - (step - alone) / bare) if bare else None)
        _write(comm, row)
        topo.free()


class _Local:
    """A receive that fills its buffer here (a copy's worth of memory traffic) and a send that does nothing."""

    def __init__(self, x=None):
        if x is not None:
            x[...] = 0

    def wait(self):
        return None


def _without_ring_messages(comm, topo, model, reducer, x, steps=3) -> float:
    """The median step (the slowest rank's) with the cp group's point-to-point messages replaced by _Local."""
    from mpi4py import MPI

    from mpi_tp.parallel.finalize import finalize_grads
    group = topo.cp
    group.isend, group.irecv = (lambda a, dest, tag: _Local()), (lambda a, source, tag: _Local(a))
    times = []
    try:
        for _ in range(steps):
            comm.Barrier()
            t0 = time.perf_counter()
            model.zero_grad()
            model.forward(x[:, :-1], x[:, 1:])
            model.backward(reducer=reducer)
            finalize_grads(model, reducer)
            times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    finally:
        del group.isend, group.irecv
    return float(numpy.median(times))


def _bare_ring(topo, split, N, repeats=3) -> float:
    """Seconds per step of the ring's messages alone: 3Z - 2 hops per layer of this rank's K and V."""
    from mpi4py import MPI
    group, r = topo.cp, topo.cp.rank
    best = []
    for _ in range(repeats):
        topo.cp.comm.Barrier()
        t0 = time.perf_counter()
        for _layer in range(L):
            for hop in range(3 * N - 2):
                src = (r - hop) % N
                kv = numpy.ones((2, B, H, split.length(src), C // H), numpy.float32)
                nxt = numpy.empty((2, B, H, split.length((src - 1) % N), C // H), numpy.float32)
                for req in (group.isend(kv, (r + 1) % N, 77), group.irecv(nxt, (r - 1) % N, 77)):
                    req.wait()
        best.append(topo.cp.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(numpy.median(best))


def _write(comm, row):
    if comm.Get_rank() == 0:
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in row if k not in ("machine", "command")}), flush=True)


def draw():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(OUT)]
    latest = {}
    for r in rows:
        latest[r["cp"], r["S"]] = r
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for cp in sorted({k[0] for k in latest}):
        pts = sorted((S, r) for (c, S), r in latest.items() if c == cp)
        run = [(S, r) for S, r in pts if r["fits"]]
        label = f"cp {cp}" + (" (oversubscribed)" if any(r["oversubscribed"] for _, r in run) else "")
        a.plot([S for S, _ in run], [r["activation_bytes"] / 2**20 for _, r in run], "o-", label=label)
        out = [(S, r) for S, r in pts if not r["fits"]]
        if out:
            a.plot([S for S, _ in out], [r["formula_activation_bytes"] / 2**20 for _, r in out], "x",
                   color=a.lines[-1].get_color(), label=f"cp {cp}: formula, over the budget")
        b.plot([S for S, _ in run], [r["step_s"] for _, r in run], "o-", label=label)
    a.axhline(BUDGET / 2**20, color="grey", ls="--", lw=1, label="budget: 1 GiB per rank")
    for ax, title, unit in ((a, "activations kept per rank (2 blocks)", "MiB"), (b, "training step", "s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=8)
    share = [f"cp {c} S {S}: {100 * r['ring_bare_s'] / r['step_s']:.1f}%" for (c, S), r in sorted(latest.items())
             if r.get("ring_bare_s")]
    machine = rows[-1]["machine"]
    fig.suptitle(f"context parallelism (C {C}, H {H}, L {L}, B {B}, float32); {machine}\n"
                 f"the ring's messages alone, share of the step: {', '.join(share[:2] + share[-2:])}", fontsize=9)
    fig.text(0.01, 0.01, "for n in 1 2 4; do mpiexec -n $n python -m mpi4py experiments/memory/context_parallel.py; "
             "done; python experiments/memory/context_parallel.py --draw "
             "(raw: experiments/memory/results/context_parallel.jsonl)",
             fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(FIG, dpi=110)
    print(f"wrote {FIG}")


if __name__ == "__main__":
    if "--draw" in sys.argv:
        draw()
    else:
        from mpi4py import MPI
        measure(MPI.COMM_WORLD)
