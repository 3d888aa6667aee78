"""`mpi-tp bench --inference`: cached decoding (mpi_tp.inference.decode) timed against the memory
bandwidth limit measured in the same run.

    OMP_NUM_THREADS=1 mpi-tp bench --inference                        # shape c, T = 1, batches 1 4 16
    mpiexec -n 2 mpi-tp bench --inference --json out.jsonl            # T = 2 (tensor parallelism = ranks)
    mpiexec -n 2 mpi-tp bench --inference --backend cupy              # on GPUs, one per rank

Per batch B: B prompts of --prompt-len random bytes through Decoder.prefill (the
time to first token, TTFT), then --new-tokens Decoder.step calls, each row's
next byte the argmax of its logits. Those logits are the same gathered array on
every rank, so every rank chooses the same bytes: no broadcast (mpi-tp generate
adds one of B int64 per step). A repeat is one prefill and its steps, after one
untimed repeat; times are the slowest rank's. Decode latency is one step (one
new byte for each of the B rows): median and p90 over steps and repeats;
tokens/s = B x steps / decode time. The shape's batch is not used: --batch is.

Collectives per decode step, as topo.stats counts them (none at T = 1):

    all-reduce  2 L + 1 calls of (B, 1, C): two per block (the row-split output
                projections of attention and of the MLP) and the embedding's
    all-gather  1 call, B x V values: the last position's logits over the vocabulary split

bytes = ((2 L + 1) B C + B V) x itemsize. The share of decode time in
collectives is their counted seconds over the decode time, on the rank where
it is largest; it includes waiting for a slower rank. The floor next to it is
the same collectives back to back with nothing between them (no waiting): what
the transfers themselves cost.

The limit: a step must read, on each rank, every one of its weight shards once
(the tied table wte_i for the head; of the position table only the B rows used)
and the keys and values of its H_i heads filled so far (2 L B H_i S_ctx hs values at
a context of S_ctx positions, averaged over the steps). limit_ms is those bytes over the rank's
memory bandwidth, measured in the same run with every rank at once: the
fastest of 7 x @ W with x (1, K) and W a float32 (K, O) matrix of
BANDWIDTH_MIB, bigger than the caches, before each batch (the best is used).
That vector-matrix product is the kernel a batch-1 step is made of (a matrix
read once, no reuse), with this BLAS and every rank competing for the memory
bus as they do in the step; a plain copy would count writes too. The report gives measured / limit per batch; from B of
a few rows on, the products reuse each weight B times and compute, not memory,
sets the pace (the limit stays nearly flat while the work grows with B).
"""
from __future__ import annotations

import json
import os
import time

import numpy
from mpi4py import MPI

from mpi_tp.core import backend
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import rank0_print
from mpi_tp.inference.decode import Decoder
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

BANDWIDTH_MIB = 128           # per rank: past the L3s measured (32-48 MiB): the product streams from memory


def add_arguments(b) -> None:
    b.add_argument("--inference", action="store_true",
                   help="time cached decoding instead (mpi_tp.commands.bench.inference): prefill, decode "
                        "steps, collectives, against the memory bandwidth limit; default shape c")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="with --inference: batch sizes")
    b.add_argument("--prompt-len", type=int, default=64, help="with --inference: prompt bytes (default 64)")
    b.add_argument("--new-tokens", type=int, default=32, help="with --inference: decode steps (default 32)")
    b.add_argument("--repeats", type=int, default=3, help="with --inference: timed repeats (default 3)")


def check(args, shapes) -> None:
    """Refuse what --inference cannot do, before anything starts (every rank runs it)."""
    if args.pp > 1 or args.dp > 1 or args.sequence_parallel or args.sweep:
        raise UserError("--inference runs plain tensor parallelism over all ranks: no --pp, --dp, "
                        "--sequence-parallel or --sweep")
    if min(args.batch) < 1 or args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1:
        raise UserError("--batch, --prompt-len, --new-tokens and --repeats must be at least 1")
    for C, H, L, S, _ in shapes:
        if args.prompt_len + args.new_tokens > S:
            raise UserError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} must stay within "
                            f"block_size {S} (past it the decoder prefills its window again)")


def memory_bandwidth(comm, dtype="float32", mib=BANDWIDTH_MIB, reps=7) -> float:
    """GB/s at which x (1, K) @ W (K, O) reads W (mib MiB) on this rank while every rank does the same:
    the fastest of reps (noise on a shared machine only slows a read down)."""
    xp, K = backend.xp(), 2048
    O = mib * 2 ** 20 // (numpy.dtype(dtype).itemsize * K)
    W = xp.full((K, O), 0.5, dtype=dtype)
    x = xp.ones((1, K), dtype=dtype)
    x @ W
    backend.synchronize()                # GPU: the warm-up's product is not in the first timing
    best = float("inf")
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        x @ W
        backend.synchronize()
        best = min(best, time.perf_counter() - t)
    return W.nbytes / best / 1e9


def collective_floor(topo, model, B, reps=50) -> float:
    """Seconds of one decode step's collectives alone, back to back (no work between them, so no rank
    waits for another): the median over reps. 0 at T = 1."""
    if topo.tp.size == 1:
        return 0.0
    xp, C = backend.xp(), model.cfg.n_embd
    sizes = model.embedding.wte.sizes
    x, logits = xp.ones((B, 1, C), dtype=model.dtype), xp.ones((B, sizes[topo.tp.rank]), model.dtype)
    times = []
    for _ in range(reps + 5):
        topo.tp.comm.Barrier()
        t = time.perf_counter()
        for _ in range(2 * len(model.h) + 1):
            topo.tp.all_reduce(x)
        topo.tp.all_gather_last(logits, sizes)
        backend.synchronize()            # GPU: until the gathered logits have landed
        times.append(time.perf_counter() - t)
    topo.stats.reset()
    return float(numpy.median(times[5:]))


def formula(L, C, V, B, tp, itemsize) -> dict:
    """Collectives of one decode step (see the module's docstring): {key: {"calls", "bytes"}}."""
    if tp == 1:
        return {}
    return {"tp/all_gather": {"calls": 1, "bytes": B * V * itemsize},
            "tp/all_reduce": {"calls": 2 * L + 1, "bytes": (2 * L + 1) * B * C * itemsize}}


def step_bytes(model, B, n) -> dict:
    """What this rank must read for one decode step at a context of n positions (S_ctx): its weight
    shards and its cache."""
    weights = sum(p.data.nbytes for p in model.parameters())
    wpe = model.embedding.wpe                       # GPT-2: one row of the position table per sequence
    if wpe is not None:
        weights += B * wpe.data[0].nbytes - wpe.data.nbytes
    attn = model.h[0].attn
    n = min(n, model.cfg.sliding_window or n)       # a sliding window: its last W positions only
    kv = 2 * len(model.h) * B * attn.H_kv_i * n * attn.hs * model.dtype.itemsize     # the key/value heads
    return {"weights": int(weights), "kv_cache": int(kv)}


def run_batch(comm, model, topo, B, prompt_len, new_tokens, repeats, seed=0) -> dict:
    """Prefill and decode one batch (1 untimed repeat, then `repeats`)."""
    rng = numpy.random.default_rng(seed)
    prompts = [bytes(rng.integers(0, 256, prompt_len).tolist()) for _ in range(B)]
    dec = Decoder(model, B)
    ttft, steps, counted, comm_s = [], [], [], []
    for r in range(1 + repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        logits = dec.prefill(prompts)
        t_prefill = time.perf_counter() - t0
        topo.stats.reset()
        comm.Barrier()
        ts = numpy.zeros(new_tokens)
        for i in range(new_tokens):
            nxt = logits.argmax(axis=1)
            t = time.perf_counter()
            logits = dec.step(nxt)
            ts[i] = time.perf_counter() - t
        if r == 0:
            continue
        ttft.append(comm.allreduce(t_prefill, op=MPI.MAX))
        comm.Allreduce(MPI.IN_PLACE, ts, op=MPI.MAX)             # each step: the slowest rank's
        steps.append(ts)
        counted.append(topo.stats.snapshot())
        comm_s.append(comm.allreduce(topo.stats.total_seconds() / ts.sum(), op=MPI.MAX))
    steps = numpy.concatenate(steps)
    snap = counted[-1]
    measured = {k: {"calls": v["calls"] / new_tokens, "bytes": v["bytes"] / new_tokens} for k, v in snap.items()}
    comm_ms = {k: 1e3 * float(numpy.median([c.get(k, {}).get("seconds", 0.0) for c in counted])) / new_tokens
               for k in snap}
    n_mean = prompt_len + (new_tokens + 1) / 2                    # context of the average step
    floor = comm.allreduce(collective_floor(topo, model, B), op=MPI.MAX)
    return {"batch": B, "steps": steps, "ttft": ttft, "collectives": measured, "comm_ms": comm_ms, "floor": floor,
            "comm_share": float(numpy.median(comm_s)), "read": step_bytes(model, B, n_mean)}


def run_inference_shape(comm, C, H, L, S, batches, prompt_len, new_tokens, repeats, dtype="float32",
                        seed=0) -> list[dict]:
    """One JSON-ready result per batch at one shape, T = world size."""
    topo = Topology.create(comm, tp=comm.Get_size())
    cfg = GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S)
    model = GPT(cfg, topo, dtype=dtype, seed=seed).eval()
    out, bws = [], []
    for B in batches:
        bws.append(memory_bandwidth(comm, dtype))           # before each batch: the best of them is used
        load = os.getloadavg()[0]                            # a shared machine: say how busy it was
        r = run_batch(comm, model, topo, B, prompt_len, new_tokens, repeats, seed)
        step, med = r["steps"], float(numpy.median(r["steps"]))
        out.append({
            "mode": "inference", "shape": {"n_embd": C, "n_head": H, "n_layer": L, "block_size": S},
            "tp": topo.tp.size, "dtype": dtype, "batch": B, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "repeats": repeats,
            "ttft_ms": {"median": 1e3 * float(numpy.median(r["ttft"])), "min": 1e3 * min(r["ttft"]),
                        "max": 1e3 * max(r["ttft"])},
            "decode_ms_per_step": {"median": 1e3 * med, "p90": 1e3 * float(numpy.percentile(step, 90)),
                                   "min": 1e3 * float(step.min()), "max": 1e3 * float(step.max())},
            "tokens_per_s": B * step.size / float(step.sum()),
            "comm_share": r["comm_share"], "comm_ms_per_step": r["comm_ms"],
            "comm_floor_ms_per_step": 1e3 * r["floor"],
            "collectives_per_step": {"measured": r["collectives"],
                                     "formula": formula(L, C, cfg.vocab_size, B, topo.tp.size,
                                                        model.dtype.itemsize)},
            "read_bytes_per_step_rank0": r["read"], "loadavg_1min": [load, os.getloadavg()[0]]})
    bw = max(bws)
    best = comm.allgather(bw)
    for r in out:
        read = r["read_bytes_per_step_rank0"]                # each rank's own, in its own copy
        limit = comm.allreduce((read["weights"] + read["kv_cache"]) / (bw * 1e9), op=MPI.MAX)
        r.update({"bandwidth_gbs_per_rank": best,
                  "bandwidth_kernel": f"x (1, 2048) @ W (2048, O), {BANDWIDTH_MIB} MiB {dtype} per rank, all "
                                      f"ranks at once, best of 7 before each batch",
                  "limit_ms": 1e3 * limit, "limit_ratio": r["decode_ms_per_step"]["median"] / (1e3 * limit)})
    topo.free()
    return out


def _counted(measured: dict, formula: dict, key: str) -> str:
    """'calls/bytes' counted per step for one kind of collective, with the formula's if they differ."""
    got, want = measured.get(key, {"calls": 0, "bytes": 0}), formula.get(key, {"calls": 0, "bytes": 0})
    differs = (got["calls"], got["bytes"]) != (want["calls"], want["bytes"])
    return f"{got['calls']:g}/{got['bytes']:,.0f}" + (f" (formula {want['calls']}/{want['bytes']})" if differs else "")


def print_inference(rows: list[dict]) -> str:
    s, r0 = rows[0]["shape"], rows[0]
    lines = [(f"cached decoding, C={s['n_embd']} H={s['n_head']} L={s['n_layer']} S={s['block_size']} "
              f"tp={r0['tp']} {r0['dtype']}: prompt {r0['prompt_len']} bytes, {r0['new_tokens']} steps x "
              f"{r0['repeats']} repeats; bandwidth (x @ W, all ranks at once) "
              f"{', '.join(f'{b:.1f}' for b in r0['bandwidth_gbs_per_rank'])} GB/s per rank"),
             (f"{'B':>4} {'TTFT ms':>8} {'step ms':>8} {'p90':>7} {'tok/s':>7} {'comm %':>7} {'floor %':>7} "
              f"{'all-reduce calls/bytes':>22} {'all-gather calls/bytes':>22} {'MB read':>8} {'limit ms':>8} "
              f"{'x limit':>7}")]
    for r in rows:
        counted = r["collectives_per_step"]
        ar, ag = (_counted(counted["measured"], counted["formula"], k) for k in ("tp/all_reduce", "tp/all_gather"))
        read, step = r["read_bytes_per_step_rank0"], r["decode_ms_per_step"]
        lines.append(f"{r['batch']:>4} {r['ttft_ms']['median']:>8.1f} {step['median']:>8.2f} {step['p90']:>7.2f} "
                     f"{r['tokens_per_s']:>7,.0f} {100 * r['comm_share']:>6.1f}% "
                     f"{100 * r['comm_floor_ms_per_step'] / step['median']:>6.1f}% {ar:>22} {ag:>22} "
                     f"{(read['weights'] + read['kv_cache']) / 1e6:>8.1f} {r['limit_ms']:>8.2f} "
                     f"{r['limit_ratio']:>7.2f}")
    lines.append("  per decode step: collectives as counted (equal to the closed form, (2L+1) all-reduces of "
                 "(B,1,C) and one all-gather of B x V, unless marked); floor: the same collectives back to back; "
                 "MB read: rank 0's weight shards + KV cache")
    return "\n".join(lines)


def cmd_inference(args, comm, shapes, env) -> int:
    for C, H, L, S, _ in shapes:
        rows = run_inference_shape(comm, C, H, L, S, args.batch, args.prompt_len, args.new_tokens, args.repeats,
                                   args.dtype)
        rank0_print(print_inference(rows), comm=comm)
        if args.json and comm.Get_rank() == 0:
            with open(args.json, "a") as f:
                for r in rows:
                    f.write(json.dumps(dict(r, environment=env)) + "\n")
    return 0
