"""mpi_tp's training step and PyTorch's, kernel family by kernel family, at T = 1, in one run (issue 26).

    python experiments/vs_torch/kernels_vs_torch.py --torch-python /tmp/torchpeer/venv/bin/python --rounds 3

compare_torch.py says which of the two steps is faster; this says where. For each shape (a, b, c) and
round, the two sides run one after the other, each in its own process, one thread: 3 warm-up steps, then
10 timed steps (medians of forward + backward and of the optimizer: the update, zero_grad, and on our
side clipping's norm), the time of each kernel family per forward + backward:

    GEMMs       kernels.matmul (mpi_tp.core.blas: the linear layers)   aten::mm, aten::addmm (bias included)
    attention   kernels.attention_forward / _backward                 scaled_dot_product_attention's ops
    GELU        kernels.gelu_forward / _backward                      aten::gelu(_backward)
    LayerNorm   kernels.layernorm_forward / _backward                 aten::native_layer_norm(_backward)
    rest        forward + backward minus the four: embedding, loss, residual adds, copies, Python

mpi_tp: the kernel functions wrapped in timers (a microsecond a call) during the timed steps themselves;
PyTorch: 5 more passes under torch.profiler (whose own cost is large), each family its ops' own CPU time.
Each family is the median over its passes; "rest" is the forward + backward median less them (noisy on
PyTorch's side: two sets of passes). The table gives the medians over rounds, the step ratio (the median
of each round's mpi_tp / PyTorch) and the GEMM floor: mpi_tp's GEMMs alone over PyTorch's step. Where
both multiply with the same library (MKL, on Intel) no change outside the products brings the ratio below
that floor. One JSON line per side and round in --out (the machine, GEMM library, date and command in
each); --replot prints the table again.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {"a": (256, 4, 4, 128, 8), "b": (512, 8, 4, 128, 8), "c": (1024, 16, 2, 128, 4)}   # C, H, L, S, B
FAMILIES = ("GEMMs", "attention", "GELU", "LayerNorm")
V, WARMUP, TIMED, PROFILED = 256, 3, 10, 5


def _ours(shape):
    """(forward_backward(), optimizer(), families() -> {family: seconds since the last call}) of mpi_tp: the
    kernel functions are wrapped in timers (a microsecond a call), so every timed pass is measured too."""
    import numpy

    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from mpi_tp.core import kernels
    from mpi_tp.core.runtime import keep_freed_memory
    from mpi_tp.model.config import GPTConfig
    from mpi_tp.model.gpt import GPT
    from mpi_tp.training.optim import AdamW, clip_coefficient
    keep_freed_memory()                                              # as mpi-tp train and bench do
    spent = {f: 0.0 for f in FAMILIES}

    def timed(fn, family):
        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[family] += time.perf_counter() - t
        return wrapper
    for name, family in (("matmul", "GEMMs"), ("attention_forward", "attention"), ("attention_backward", "attention"),
                         ("gelu_forward", "GELU"), ("gelu_backward", "GELU"),
                         ("layernorm_forward", "LayerNorm"), ("layernorm_backward", "LayerNorm")):
        setattr(kernels, name, timed(getattr(kernels, name), family))   # the model calls them through kernels
    C, H, L, S, B = SHAPES[shape]
    model = GPT(GPTConfig(n_layer=L, n_head=H, n_embd=C, block_size=S), dtype="float32", seed=0)
    opt = AdamW(model.parameters(), lr=1e-4)
    x = numpy.random.default_rng(0).integers(0, V, (B, S + 1))

    def fwd_bwd():
        model.forward(x[:, :-1], x[:, 1:])
        model.backward()

    def optimizer():
        opt.step(grad_scale=clip_coefficient(opt.grad_norm(model.topo.tp), 1.0))
        model.zero_grad()

    def families():
        out = dict(spent)
        spent.update((f, 0.0) for f in FAMILIES)
        return out
    return fwd_bwd, optimizer, families


def _torch(shape, peer):
    """The same three for the peer's PyTorch GPT (gpt_tp.py: same shapes, Adam, sdpa attention)."""
    import torch
    sys.path.insert(0, peer)
    import gpt_tp
    torch.set_num_threads(1)
    cfg = dict(gpt_tp.CONFIGS[shape])
    cfg.update(fused_qkv=False, attn_impl="sdpa", tied=True)          # gpt_tp.py's defaults
    torch.manual_seed(0)
    model = gpt_tp.GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    idx, tgt = gpt_tp.make_batch(cfg, 0)

    def fwd_bwd():
        model(idx, tgt).backward()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def families():
        """One forward + backward under torch.profiler: each family's ops' own time."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fwd_bwd()
        out = {f: 0.0 for f in FAMILIES}
        for e in prof.key_averages():
            n = e.key
            fam = ("GEMMs" if n in ("aten::mm", "aten::addmm") else
                   "attention" if "scaled_dot_product" in n and n.startswith("aten::_") else
                   "GELU" if n in ("aten::gelu", "aten::gelu_backward") else
                   "LayerNorm" if n in ("aten::native_layer_norm", "aten::native_layer_norm_backward") else None)
            if fam:
                out[fam] += e.self_cpu_time_total / 1e6
        return out
    return fwd_bwd, optimizer, families


def side(name, shape, peer):
    """Run one side in this process; print its JSON line: medians over the passes of forward + backward,
    the optimizer and each family (mpi_tp: the timed passes themselves; PyTorch: PROFILED passes more)."""
    fwd_bwd, optimizer, families = _ours(shape) if name == "mpi_tp" else _torch(shape, peer)
    for _ in range(WARMUP):
        fwd_bwd()
        optimizer()
    fb, op, fam = [], [], []
    for _ in range(TIMED):
        if name == "mpi_tp":
            families()                                    # from zero
        t0 = time.perf_counter()
        fwd_bwd()
        t1 = time.perf_counter()
        if name == "mpi_tp":
            fam.append(families())
        optimizer()
        fb.append(t1 - t0)
        op.append(time.perf_counter() - t1)
    for _ in range(PROFILED if name == "torch" else 0):
        fam.append(families())
        optimizer()
    med = statistics.median(fb)
    ms = {f: 1e3 * statistics.median(p[f] for p in fam) for f in FAMILIES}
    print(json.dumps({"impl": name, "shape": shape, "fwd_bwd_ms": 1e3 * med,
                      "optimizer_ms": 1e3 * statistics.median(op), "step_ms": 1e3 * (med + statistics.median(op)),
                      "families_ms": ms}))


def table(rows, shapes):
    """Markdown: per shape, the medians over rounds of each family on both sides; the step ratio (the median of
    each round's) and the GEMM floor (mpi_tp's GEMMs alone over PyTorch's step)."""
    out = ["| shape | side | step ms | GEMMs | attention | GELU | LayerNorm | rest of fwd + bwd | optimizer "
           "| mpi_tp / PyTorch | GEMM floor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        by = {impl: {r["round"]: r for r in rows if r["shape"] == shape and r["impl"] == impl}
              for impl in ("mpi_tp", "torch")}
        if not by["mpi_tp"] or not by["torch"]:
            continue
        both = sorted(set(by["mpi_tp"]) & set(by["torch"]))
        ratio = statistics.median(by["mpi_tp"][k]["step_ms"] / by["torch"][k]["step_ms"] for k in both)
        floor = statistics.median(by["mpi_tp"][k]["families_ms"]["GEMMs"] / by["torch"][k]["step_ms"] for k in both)
        for impl, rs in by.items():
            med = lambda get: statistics.median(get(r) for r in rs.values())          # noqa: E731
            fams = [med(lambda r, f=f: r["families_ms"][f]) for f in FAMILIES]
            fams.append(med(lambda r: r["fwd_bwd_ms"] - sum(r["families_ms"][f] for f in FAMILIES)))
            last = f"| {ratio:.2f} | {floor:.2f} |" if impl == "mpi_tp" else "| | |"
            out.append(f"| {shape} | {'PyTorch' if impl == 'torch' else impl} | {med(lambda r: r['step_ms']):.0f} | "
                       + " | ".join(f"{v:.1f}" for v in fams) + f" | {med(lambda r: r['optimizer_ms']):.1f} " + last)
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer", default=os.path.join(HERE, "..", "..", "..", "shared", "peers", "torch_tp"))
    ap.add_argument("--torch-python", default="/tmp/torchpeer/venv/bin/python")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kernels_vs_torch.jsonl"))
    ap.add_argument("--replot", action="store_true", help="only print the table from --out")
    ap.add_argument("--side", choices=["mpi_tp", "torch"], help=argparse.SUPPRESS)     # one side, in-process
    ap.add_argument("--shape", choices=list(SHAPES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        side(args.side, args.shape, os.path.abspath(args.peer))
        return
    if args.replot:
        if not os.path.isfile(args.out):
            sys.exit(f"no {args.out}: run the comparison first (without --replot)")
        with open(args.out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(f"{rows[0]['machine']}; mpi_tp's GEMMs by {rows[0]['gemm_library']}; {rows[0]['date']}\n")
        print(table(rows, args.shapes))
        return
    peer = os.path.abspath(args.peer)
    if not os.path.isfile(os.path.join(peer, "gpt_tp.py")) or not os.path.isfile(args.torch_python):
        sys.exit(f"need the peer ({peer}/gpt_tp.py) and its python ({args.torch_python}); see --help")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from mpi_tp.core.blas import which
    from mpi_tp.core.runtime import machine_text
    stamp = {"machine": machine_text(), "gemm_library": which(), "date": time.strftime("%Y-%m-%d %H:%M"),
             "command": "python experiments/vs_torch/kernels_vs_torch.py " + " ".join(sys.argv[1:])}
    rows = []
    for rnd in range(args.rounds):
        for shape in args.shapes:
            for impl, py in (("mpi_tp", sys.executable), ("torch", args.torch_python)):
                cmd = [py, os.path.abspath(__file__), "--side", impl, "--shape", shape, "--peer", peer]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
                if r.returncode != 0:
                    sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
                row = dict(json.loads(r.stdout.strip().splitlines()[-1]), round=rnd, **stamp)
                rows.append(row)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"round {rnd} shape {shape} {impl}: {row['step_ms']:.1f} ms", flush=True)
    print(f"\n{stamp['machine']}; mpi_tp's GEMMs by {stamp['gemm_library']}; "
          f"medians of {args.rounds} rounds, ms per step\n")
    print(table(rows, args.shapes))


if __name__ == "__main__":
    main()
