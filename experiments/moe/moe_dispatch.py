"""What a mixture-of-experts MLP sends (all-to-all, or all-gather) against a dense MLP of the same active FLOPs
(all-reduce), and how the capacity factor trades dropped tokens for balance.

    mpiexec -n 2 python -m mpi4py experiments/moe/moe_dispatch.py       # T = 2: its lines, then the figures
    mpiexec -n 4 python -m mpi4py experiments/moe/moe_dispatch.py       # T = 4 (oversubscribed on 2 cores)
    python experiments/moe/moe_dispatch.py --plot                       # only redraw, from the raw file

Every point is `mpi-tp bench --moe`'s measurement (commands.bench.moe.run_moe_shape,
float32, C 256, S 128, B 4 sequences per replica, 5 timed steps after 2): the MoE
MLP at ep = dp = T beside the dense MLP of width k 4C at tp = T on the same
T B S tokens. Inputs: the default training data's bytes (the built-in pydoc
corpus, T B windows of S bytes at seeded offsets), embedded by a randomly
initialised table and position table (N(0, 0.02), as GPT's) and normalised per
token as ln_2 would (no attention before it); the router is the layer's random
initialisation. So the routing is that of an untrained model on real bytes:
skewed by byte frequencies, not balanced by any training.

- bytes: E in {2, 4, 8} (E >= T), k in {1, 2}, dropless, each point with both
  dispatchers (--moe-dispatcher alltoall, then allgather; each call times the
  dense MLP too, step by step alternating with the MoE). Per rank and per
  token of the global batch, wire bytes: the all-to-all's (rows and counts),
  the all-gather dispatcher's (ring: (T - 1) / T of its all-gathers' and
  reduce-scatters' buffers, and the counts), the dense MLP's ring all-reduce;
  the formulas are 4 k (T - 1) / T^2 C x 4 (uniform routing), 4 k (T - 1) / T
  C x 4 (exact when dropless: every row goes to every rank) and 4 (T - 1) / T
  C x 4.
- capacity: E 8, k in {1, 2}, capacity factor 0.5 .. 2 and dropless: the share
  of assignments dropped, max / mean tokens per expert (after and before the
  capacity) and the all-to-all bytes per token.

A run replaces its own T's lines of experiments/moe/results/moe_dispatch.jsonl
(with the machine and the 1-minute load average of each point) and draws
docs/figures/moe_dispatch.png (all-to-all vs dense, both T if present),
moe_dispatchers.png (the two dispatchers: bytes and step time) and
moe_capacity.png (T = 2).
"""
import argparse
import json
import os
import sys
import textwrap

import numpy
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "moe_dispatch.jsonl")
FIGURES = os.path.join(HERE, "..", "..", "docs", "figures")
C, S, B = 256, 128, 4
CAPACITIES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 0.0)
DISPATCHERS = ("alltoall", "allgather")
STEPS = 7


def kind(r):
    return r["moe"].get("dispatcher", "alltoall")


def inputs(T, seed=0):
    """(T B, S, C) float32: pydoc bytes through a random embedding and position table, normalised per token."""
    from mpi_tp.core.params import normal_shard
    from mpi_tp.training.data import load_corpus
    data = load_corpus("pydoc").data
    starts = numpy.random.default_rng(seed).integers(0, len(data) - S, T * B)
    ids = numpy.stack([data[s:s + S] for s in starts]).astype(numpy.int64)
    wte = normal_shard("wte", (256, C), 0.02, seed, numpy.float32, None, 0, None)
    wpe = normal_shard("wpe", (S, C), 0.02, seed, numpy.float32, None, 0, None)
    x = wte[ids] + wpe
    x = (x - x.mean(-1, keepdims=True)) / numpy.sqrt(x.var(-1, keepdims=True) + 1e-5)
    return x.astype(numpy.float32)


def measure(comm):
    from mpi_tp.commands.bench import environment
    from mpi_tp.commands.bench.moe import run_moe_shape
    T = comm.Get_size()
    x, env, rows = inputs(T), environment(comm), []
    crowded = f"{T} ranks on {os.cpu_count()} cores (oversubscribed)" if T > os.cpu_count() else ""
    points = [("bytes", E, k, 0.0, d) for E in (2, 4, 8) if E >= T for k in (1, 2) for d in DISPATCHERS]
    if T == 2:
        points += [("capacity", 8, k, c, "alltoall") for k in (1, 2) for c in CAPACITIES]
    for experiment, E, k, capacity, dispatcher in points:
        load0 = os.getloadavg()[0]
        r = run_moe_shape(comm, C, S, B, E, k, capacity, steps=STEPS, warmup=2, x=x,
                          routing={"moe_dispatcher": dispatcher})
        r.update(experiment=experiment, environment=env, loadavg_start=load0, loadavg_end=os.getloadavg()[0])
        if crowded:
            r["oversubscribed"] = crowded
        rows.append(r)
        if comm.Get_rank() == 0:
            m, d = r["moe"], r["dense"]
            print(f"{experiment} T={T} E={E} k={k} capacity={capacity:g} {dispatcher}: MoE "
                  f"{m['bytes_per_token']:.0f} B/token, {m['step_ms']['median']:.0f} ms ({dispatcher} "
                  f"{m['dispatch_ms']:.1f}); dense {d['bytes_per_token']:.0f} "
                  f"B/token, {d['step_ms']['median']:.0f} ms (ar {d['all_reduce_ms']:.1f}); dropped "
                  f"{100 * m['dropped_fraction']:.1f}%, imbalance {m['imbalance']:.2f}; load {load0:.2f}", flush=True)
    return rows


def read_lines():
    if not os.path.exists(RESULTS):
        return []
    with open(RESULTS) as f:
        return [json.loads(line) for line in f if line.strip()]


def tables(rows):
    """The text tables of docs/parallelism.md ("Experts")."""
    out = ["bytes sent per rank per token of the global batch (float32, C 256; dropless):",
           "  T  E  k   MoE a2a  formula   dense ar  formula   MoE ms  (a2a)   dense ms  (ar)  max/mean"]
    byte_rows = [r for r in rows if r["experiment"] == "bytes"]
    a2a_rows = [r for r in byte_rows if kind(r) == "alltoall"]
    for r in sorted(a2a_rows, key=lambda r: (r["ranks"], r["experts"], r["top_k"])):
        T, k, m, d = r["ranks"], r["top_k"], r["moe"], r["dense"]
        crowded = "  (oversubscribed)" if "oversubscribed" in r else ""
        out.append(f"{T:3d} {r['experts']:2d} {k:2d} {m['bytes_per_token']:9.0f} "
                   f"{4 * k * (T - 1) / T ** 2 * C * 4:8.0f} {d['bytes_per_token']:10.0f} "
                   f"{4 * (T - 1) / T * C * 4:8.0f} {m['step_ms']['median']:8.0f} {m['dispatch_ms']:6.1f} "
                   f"{d['step_ms']['median']:10.0f} {d['all_reduce_ms']:5.1f} {m['imbalance']:9.2f}{crowded}")
    out += ["", "the two dispatchers (wire bytes per rank per token; ms: MoE step, in brackets its collectives, "
            "then the dense step of the same call; load: 1-min average at the start of each call):",
            "  T  E  k   a2a B/tok  formula   ag B/tok  formula   a2a ms (coll) dense   ag ms (coll) dense"
            "  ag/a2a*  load"]
    pairs = {}
    for r in byte_rows:
        pairs.setdefault((r["ranks"], r["experts"], r["top_k"]), {})[kind(r)] = r
    for (T, E, k), p in sorted(pairs.items()):
        if len(p) < 2:
            continue
        a, g = p["alltoall"], p["allgather"]
        ratio = (g["moe"]["step_ms"]["median"] / g["dense"]["step_ms"]["median"]) / (
            a["moe"]["step_ms"]["median"] / a["dense"]["step_ms"]["median"])
        out.append(f"{T:3d} {E:2d} {k:2d} {a['moe']['bytes_per_token']:11.0f} {4 * k * (T - 1) / T ** 2 * C * 4:8.0f} "
                   f"{g['moe']['bytes_per_token']:10.0f} {4 * k * (T - 1) / T * C * 4:8.0f} "
                   f"{a['moe']['step_ms']['median']:8.0f} ({a['moe']['dispatch_ms']:4.0f}) "
                   f"{a['dense']['step_ms']['median']:5.0f} {g['moe']['step_ms']['median']:7.0f} "
                   f"({g['moe']['dispatch_ms']:4.0f}) {g['dense']['step_ms']['median']:5.0f} {ratio:7.2f}  "
                   f"{a['loadavg_start']:.1f}/{g['loadavg_start']:.1f}"
                   + ("  (oversubscribed)" if "oversubscribed" in a else ""))
    out.append("  * (ag step / its dense step) / (a2a step / its dense step): the dispatchers compared through the "
               "dense step each call timed beside them, which takes out some of the load's drift")
    out += ["", "capacity factor at T = 2, E 8 (0: dropless):",
            "  k  capacity  dropped  max/mean admitted  max/mean routed  busiest rank  MoE a2a B/token  MoE ms"]
    for r in sorted((r for r in rows if r["experiment"] == "capacity"), key=lambda r: (r["top_k"], r["capacity"] or 9)):
        m = r["moe"]
        out.append(f"{r['top_k']:3d} {r['capacity']:9.2f} {100 * m['dropped_fraction']:7.1f}% {m['imbalance']:18.2f} "
                   f"{m['routed_imbalance']:16.2f} {m['rank_imbalance']:13.2f} {m['bytes_per_token']:16.0f} "
                   f"{m['step_ms']['median']:7.0f}")
    return "\n".join(out)


def plot(rows, command):
    sys.path[:0] = [os.path.join(HERE, "..", "bench"), HERE]     # experiments/bench/scaling.py, moe_plots.py
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scaling import stamp
    env = dict(rows[0]["environment"], mpi=" ".join(rows[0]["environment"]["mpi"].replace("Version:", "").split()))
    loads = [x for r in rows for x in (r["loadavg_start"], r["loadavg_end"])]
    note = (stamp(env, command) + f"; 1-min load average {min(loads):.2f}-{max(loads):.2f}; shared machine; "
            f"raw: experiments/moe/results/{os.path.basename(RESULTS)}")
    crowded = sorted({r["oversubscribed"] for r in rows if "oversubscribed" in r})
    note = note.replace("\n", " | ") + "".join(f"; {c}" for c in crowded)
    written = []

    def save(fig, name):
        wrapped = "\n".join(textwrap.wrap(note, int(18 * fig.get_figwidth())))
        fig.text(0.01, 0.005, wrapped, fontsize=5.5, va="bottom", color="#555555")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        path = os.path.join(FIGURES, name)
        fig.savefig(path)
        plt.close(fig)
        written.append(path)

    byte_rows = [r for r in rows if r["experiment"] == "bytes" and kind(r) == "alltoall"]
    Ts = sorted({r["ranks"] for r in byte_rows})
    fig, axes = plt.subplots(1, len(Ts), figsize=(max(9.0, 6.5 * len(Ts)), 4.4), dpi=110, squeeze=False)
    for ax, T in zip(axes[0], Ts):
        sel = sorted((r for r in byte_rows if r["ranks"] == T), key=lambda r: (r["experts"], r["top_k"]))
        pos = numpy.arange(len(sel))
        ax.bar(pos - 0.2, [r["moe"]["bytes_per_token"] for r in sel], 0.4, color="C1",
               label="MoE: all-to-all (measured)")
        ax.bar(pos + 0.2, [r["dense"]["bytes_per_token"] for r in sel], 0.4, color="C0",
               label="dense, width k 4C: all-reduce wire (measured)")
        ax.plot(pos - 0.2, [4 * r["top_k"] * (T - 1) / T ** 2 * C * 4 for r in sel], "k_", ms=18, mew=1.5,
                label="formulas: 4k(T-1)/T² C·4, 4(T-1)/T C·4")
        ax.plot(pos + 0.2, [4 * (T - 1) / T * C * 4 for r in sel], "k_", ms=18, mew=1.5)
        ax.set_xticks(pos, [f"E={r['experts']}\nk={r['top_k']}" for r in sel])
        top = max(max(r["moe"]["bytes_per_token"], r["dense"]["bytes_per_token"]) for r in sel)
        ax.set_ylim(0, 1.45 * top)
        for i, r in enumerate(sel):
            for dx, v in ((-0.2, r["moe"]["bytes_per_token"]), (0.2, r["dense"]["bytes_per_token"])):
                ax.text(i + dx, v + 0.02 * top, f"{v:.0f}", ha="center", va="bottom", fontsize=6)
        crowded = next((f" ({r['oversubscribed']})" for r in sel if "oversubscribed" in r), "")
        skipped = f"; E < {T} cannot be split" if T > 2 else ""
        ax.set(ylabel="bytes sent per rank per token", title=f"ep = tp = T = {T}{crowded}{skipped}")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=6.5, loc="upper left")
    fig.suptitle(f"MoE MLP (ep = dp = T) vs dense MLP of the same active FLOPs (tp = T)\nC {C}, S {S}, "
                 f"B {B} sequences per replica (T B in all), float32, dropless; untrained router on pydoc bytes",
                 fontsize=9)
    save(fig, "moe_dispatch.png")
    from moe_plots import dispatchers
    fig = dispatchers(plt, [r for r in rows if r["experiment"] == "bytes"], C, S, B)
    if fig is not None:
        save(fig, "moe_dispatchers.png")

    cap_rows = [r for r in rows if r["experiment"] == "capacity"]
    if cap_rows:
        fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
        for k, color in ((1, "C0"), (2, "C1")):
            sel = sorted((r for r in cap_rows if r["top_k"] == k and r["capacity"]), key=lambda r: r["capacity"])
            free = next(r for r in cap_rows if r["top_k"] == k and not r["capacity"])
            cf = [r["capacity"] for r in sel]
            a0.plot(cf, [100 * r["moe"]["dropped_fraction"] for r in sel], "o-", color=color, label=f"k = {k}")
            a1.plot(cf, [r["moe"]["imbalance"] for r in sel], "o-", color=color, label=f"k = {k}, admitted")
            a1.axhline(free["moe"]["imbalance"], color=color, ls="--", lw=1,
                       label=f"k = {k}, dropless (= routed) {free['moe']['imbalance']:.2f}")
        a0.set(xlabel="capacity factor", ylabel="assignments dropped (%)", title="dropped")
        a1.set(xlabel="capacity factor", ylabel="max / mean tokens per expert", title="imbalance")
        for a in (a0, a1):
            a.legend(fontsize=7)
            a.title.set_fontsize(9)
        fig.suptitle(f"Capacity per sequence, E 8, T = 2; untrained router on pydoc bytes (C {C}, S {S}, "
                     f"{2 * B} sequences)", fontsize=9)
        save(fig, "moe_capacity.png")
    return written


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", action="store_true", help="only redraw the figures from the raw file")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    T = comm.Get_size()
    rows = read_lines()
    if not args.plot:
        mine = measure(comm)
        if comm.Get_rank():
            return
        rows = [r for r in rows if r["ranks"] != T] + mine
        with open(RESULTS, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    print(tables(rows))
    command = ("mpiexec -n 2 python -m mpi4py experiments/moe/moe_dispatch.py; mpiexec -n 4 ... (the same); "
               "python experiments/moe/moe_dispatch.py --plot")
    for path in plot(rows, command):
        print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
