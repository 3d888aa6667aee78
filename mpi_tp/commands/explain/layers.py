"""`mpi-tp explain`: a live lesson in how one layer is split over the tensor-parallel ranks.

    mpiexec -n 2 mpi-tp explain --layer mlp                  # T = 2
    mpiexec -n 3 mpi-tp explain --layer all --sequence-parallel
    mpiexec -n 3 mpi-tp explain --layer loss                 # the vocabulary split (explain/vocab.py)
    mpiexec -n 4 mpi-tp explain --layer step --dp 2          # one training step (explain/step.py)

Builds a tiny layer at T = world size in float64, runs a forward and a backward
pass on a fixed random input and output gradient, and prints, rank by rank, the
shard of every parameter, the shapes in and out, the collectives of each pass
(from the counters in mpi_tp.parallel.collectives, named with Megatron's f and g:
calls, buffer bytes, wire bytes and their closed form, see explain/common.py), and
how far the result is from the same layer on one rank (built from the same seed and
names, so the weights agree slice for slice). Exit status 0 when every rank of
every layer equals the serial layer.

--kv-heads H_kv shows grouped-query attention (a Llama attention and block): which key/value heads
each rank holds, its own or a replica (mpi_tp.model.heads), and the replicas' gradient sum.

Under --sequence-parallel a last line sets the wire bytes of the all-gathers and
reduce-scatters beside those of the plain layer's all-reduces: the same traffic.

Legend (docs/notation.md): B = batch, S = sequence, C = channels, H = heads, O = K = 2C + 1
(the column layer's output features O, the row layer's input features K: odd on
purpose, so shards can differ by one), F = 4C (the MLP's width); S_i, O_i, H_kv_i,
F_i, H_i = rank i's share.
"""
from __future__ import annotations

import textwrap

import numpy
from mpi4py import MPI

from mpi_tp.commands.explain import moe as explain_moe
from mpi_tp.commands.explain import step as explain_step
from mpi_tp.commands.explain import vocab as explain_vocab
from mpi_tp.commands.explain.common import phase_lines, wire_bytes
from mpi_tp.commands.explain.layer_texts import GQA_LESSON, LESSONS, SP_LESSONS
from mpi_tp.commands.explain.pipeline import lesson as pipeline_lesson
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.core.testing import all_true, max_rel_diff, randomize
from mpi_tp.model.attention import ParallelAttention
from mpi_tp.model.block import Block
from mpi_tp.model.config import GPTConfig, fewest_heads
from mpi_tp.model.forward_pass import Pass
from mpi_tp.model.mlp import ParallelMLP
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.finalize import sum_replica_grads, sum_sp_partial_grads
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning.activations import activation_bytes_per_layer

LAYERS = ("column", "row", "mlp", "attention", "block")
RTOL = 1e-10              # float64: the parallel layer only reorders sums
F64 = numpy.float64
SEED = 7

def plan(args, T: int) -> dict:
    """The sizes of the lesson, checked against the world size T (a UserError says what to change)."""
    C, B, S = args.features, args.batch, args.seq
    for flag, v in (("--features", C), ("--batch", B), ("--seq", S)):
        if v < 1:
            raise UserError(f"{flag} must be a positive integer, got {v}")
    if C < T:
        raise UserError(f"--features {C} cannot be split over {T} ranks: use --features {T} or more")
    H = fewest_heads(C, T) if args.heads is None else args.heads
    if H < T or C % H:
        raise UserError(f"--heads {H} does not fit: every one of the {T} ranks needs a head, and the heads "
                         f"must divide --features {C}; use --heads between {T} and {C} that divides {C}")
    H_kv = args.kv_heads
    if H_kv is not None and (H_kv < 1 or H % H_kv or (C // H) % 2):
        raise UserError(f"--kv-heads {H_kv} does not fit: the key/value heads must divide the {H} heads, and the "
                        f"rotary embedding needs an even head size (C / H = {C // H}); use --features and "
                        "--heads that give one, e.g. --features 16 --heads 4 --kv-heads 2")
    llama = dict(arch="llama", n_kv_head=H_kv, intermediate_size=4 * C) if H_kv is not None else {}
    cfg = GPTConfig(vocab_size=T, block_size=S, n_layer=1, n_head=H, n_embd=C, **llama)  # vocabulary unused
    cfg.validate(T)
    if args.sequence_parallel and S < T:
        raise UserError(f"--sequence-parallel cuts --seq {S} over {T} ranks: use --seq {T} or more")
    return {"cfg": cfg, "B": B, "S": S, "C": C, "K": 2 * C + 1}


def build(kind: str, p: dict, topo: Topology, sp: bool = False):
    cfg, C, K, tp = p["cfg"], p["C"], p["K"], topo.tp
    if kind == "column":
        layer = ColumnParallelLinear("column", C, K, tp, F64, seed=SEED)
    elif kind == "row":
        layer = RowParallelLinear("row", K, C, tp, F64, seed=SEED, sp=sp)
    elif kind == "mlp":
        layer = ParallelMLP("mlp", cfg, topo, F64, SEED, sp=sp)
    elif kind == "attention":
        layer = ParallelAttention("attn", cfg, topo, F64, SEED, 0, sp=sp)
    else:
        layer = Block(0, cfg, topo, F64, SEED, sp=sp)
    randomize(layer, seed=SEED)       # biases and LayerNorms too, the same slice for slice at any tp
    return layer


def _cut(a, cols=None, positions=None):
    """This rank's piece of a whole activation: its columns (last axis) and/or positions (axis 1)."""
    if cols is not None:
        a = a[..., cols]
    if positions is not None:
        a = a[:, positions]
    return numpy.ascontiguousarray(a)


def _slice_text(param) -> str:
    if not param.sharded:
        return "whole (replicated)"
    return "[" + ", ".join(f"{s.start}:{s.stop}" if s.start is not None else ":" for s in param.index()) + "]"


def explain_layer(kind: str, p: dict, comm, sequence_parallel: bool = False) -> tuple[bool, str, list, tuple]:
    """Run one layer at T = world size against its serial self; (every rank equal?, this rank's text,
    the counters of the forward and the backward pass, the activation bytes kept for the backward pass:
    (the most any rank keeps, the serial layer's))."""
    B, S, C, K = p["B"], p["S"], p["C"], p["K"]
    topo, serial = Topology.create(comm), Topology.serial()
    ps = Pass.start(topo, S, sequence_parallel)          # the pass: S positions, cut over tp under sp
    sp = ps.sp
    par, ser = build(kind, p, topo, sequence_parallel), build(kind, p, serial)
    rng = numpy.random.default_rng(SEED)
    n_in, n_out = {"column": (C, K), "row": (K, C)}.get(kind, (C, C))
    x, dout = rng.standard_normal((B, S, n_in)), rng.standard_normal((B, S, n_out))   # the same on every rank

    y_ref = ser.forward(x)                                                # the serial layer, whole sequence
    kept_ref = ser.activation_bytes()
    dx_ref = ser.backward(dout)
    # What this rank sees of x and y: a row layer's input and a column layer's output are this rank's
    # columns; under sp, whatever lies outside the parallel region is this rank's positions.
    cols = slice(par.weight.start, par.weight.stop) if kind in ("column", "row") else None
    in_cols, out_cols = (cols, None) if kind == "row" else (None, cols)
    in_pos = sp.positions if sp is not None and kind != "row" else None
    out_pos = sp.positions if sp is not None and kind != "column" else None

    topo.stats.reset()
    x_i = _cut(x, in_cols, in_pos)
    y = par.forward(x_i, sp if kind in ("column", "row") else ps)
    kept = comm.allreduce(par.activation_bytes(), op=MPI.MAX)          # a lesson: a pickled int, once
    fwd = topo.stats.snapshot()
    topo.stats.reset()
    dx = par.backward(_cut(dout, out_cols, out_pos))
    sum_sp_partial_grads(par.parameters(), topo.tp)           # as finalize_grads does once per step
    sum_replica_grads(par.parameters())                       # (grouped-query attention's kv replicas)
    bwd = topo.stats.snapshot()

    err_out = max_rel_diff(y, _cut(y_ref, out_cols, out_pos))
    err_in = max_rel_diff(dx, _cut(dx_ref, in_cols, in_pos))
    reference = {q.name: q for q in ser.parameters()}
    scale = max(float(numpy.abs(q.grad).max()) for q in ser.parameters())   # k-bias grads are ~0
    grads = {q.name: max_rel_diff(q.grad, reference[q.name].grad[q.index()], scale) for q in par.parameters()}
    worst = max(grads, key=grads.get)
    ok = max(err_out, err_in, grads[worst]) <= RTOL

    lines = [f"-- rank {topo.tp.rank} of {topo.tp.size} --"]
    lines += [f"  {q.name}: global {q.global_shape} -> shard {tuple(q.data.shape)} = {_slice_text(q)}"
              for q in par.parameters()]
    attn = par if kind == "attention" else getattr(par, "attn", None)
    sizes = {}
    if attn is not None and not p["cfg"].llama:
        lines.append(f"  heads {attn.heads.start}:{attn.heads.stop} of {p['cfg'].n_head} "
                     f"(H_i = {attn.H_i}, head size hs = {attn.hs}: {attn.H_i * attn.hs} columns of q, k and v)")
    elif attn is not None:                       # grouped-query attention: which key/value heads, split or not
        sizes["kv"] = len(attn.layout.replicas(topo.tp.rank))
        lines.append(f"  {attn.layout.describe(topo.tp.rank)}; H_i = {attn.H_i}, H_kv_i = {attn.H_kv_i}, head size "
                     f"hs = {attn.hs}: {attn.H_i * attn.hs} columns of q, {attn.H_kv_i * attn.hs} of k and of v")
    lines.append(f"  input {x_i.shape} -> output {y.shape}")
    lines += phase_lines("forward", fwd, topo.tp.size, sizes) + phase_lines("backward", bwd, topo.tp.size, sizes)
    lines.append(f"  vs serial: output {err_out:.1e}, dinp {err_in:.1e}, param grads {grads[worst]:.1e} "
                 f"(worst {worst}); tolerance {RTOL:.0e}: {'PASS' if ok else 'FAIL'}")
    topo.free()
    serial.free()
    return all_true(ok, comm), "\n".join(lines), [fwd, bwd], (kept, kept_ref)


def sp_versus_tp(kind: str, p: dict, comm, counted: list) -> tuple[bool, str, tuple]:
    """The wire bytes of the sequence-parallel layer's all-gathers and reduce-scatters (`counted`) beside
    the plain layer's all-reduces (run here again, quietly): (equal?, the one-line comparison, the plain
    layer's activation bytes). The sums are the closed forms of the counted buffer bytes (the counters
    round each to whole bytes)."""
    _, _, plain, kept_plain = explain_layer(kind, p, comm, False)
    T = comm.Get_size()

    def wire(snaps, keep):
        return sum(wire_bytes(k.split("/")[1], v["bytes"], T) for snap in snaps for k, v in snap.items() if keep(k))
    extras = ("tp/sp_grad_all_reduce", "tp/regather", "kv/kv_grad_all_reduce")    # the replicas' sum: both
    sp_wire = wire(counted, lambda k: k not in extras)
    tp_wire = wire(plain, lambda k: k != "kv/kv_grad_all_reduce")
    grads = wire(counted, lambda k: k == "tp/sp_grad_all_reduce")
    again = wire(counted, lambda k: k == "tp/regather")
    same = abs(sp_wire - tp_wire) <= 1e-9 * tp_wire
    return all_true(same, comm), (
        f"wire bytes per rank, forward + backward: sequence parallelism's all-gathers + reduce-scatters in f's "
        f"and g's places {sp_wire:.1f} {'=' if same else '!='} plain tensor parallelism's all-reduces "
        f"{tp_wire:.1f}{': the same traffic' if same else ': DIFFERENT'}; plus {again:.1f} to gather the column "
        f"layer's kept input again (what keeps 1/T of it) and {grads:.1f} for the replicated parameters' "
        f"gradients"), kept_plain


def memory_line(p: dict, T: int, kept: tuple, kept_plain: tuple) -> str:
    """The block's activations kept for the backward pass, with and without SP, against one rank's and the
    paper's count for the same sizes (mpi_tp.planning.activations: Korthikanti et al. 2022, Table 2)."""
    (sp, one), (tp, _) = kept, kept_plain
    S, B, C, H = p["S"], p["B"], p["C"], p["cfg"].n_head
    paper = [activation_bytes_per_layer(S, B, C, H, t, sp=s, paper=True) for t, s in ((T, True), (T, False), (1, False))]
    return (f"\nactivations the block keeps for the backward pass (the most on any rank): {sp} bytes with sequence "
            f"parallelism, {tp} without, {one} on one rank: SP / TP = {sp / tp:.3f}, SP / one rank = {sp / one:.3f}"
            f" (1/T = {1 / T:.3f}); Korthikanti et al.'s count for these sizes (16-bit values, dropout on): "
            f"SP / TP = {paper[0] / paper[1]:.3f}, SP / one rank = {paper[0] / paper[2]:.3f}")


def run(args, comm) -> bool:
    """Print the lesson of each requested layer from rank 0; True when every check passed."""
    if args.layer == "cp":                            # before the default --seq: its own is 4N
        from mpi_tp.commands.explain.ring import lesson as ring_lesson
        collective_setup(explain_step.refuse_step_options, args, comm=comm)
        return ring_lesson(args, comm)
    if args.seq is None:
        args.seq = 4
    if args.layer == "step":
        return explain_step.lesson(args, comm)
    collective_setup(explain_step.refuse_step_options, args, comm=comm)
    if args.layer == "pipeline":
        if args.micro_batches is not None and args.micro_batches < 1:
            raise UserError(f"--micro-batches must be at least 1, got {args.micro_batches}")
        return pipeline_lesson(comm, args.micro_batches)
    if args.layer == "moe":
        return explain_moe.lesson(args, comm)
    if args.layer == "precision":
        from mpi_tp.commands.explain.precision import lesson as precision_lesson
        return precision_lesson(args, comm)
    p = collective_setup(plan, args, comm.Get_size(), comm=comm)
    cfg, T = p["cfg"], comm.Get_size()
    kinds = LAYERS + explain_vocab.LAYERS if args.layer == "all" else (args.layer,)
    if set(kinds) & set(explain_vocab.LAYERS):        # before anything is printed
        collective_setup(explain_vocab.plan, args, T, comm=comm)
    odd = f"O = K = 2C + 1 = {p['K']}, " if {"column", "row"} & set(kinds) else ""   # only those layers use it
    kv = f"key/value heads H_kv = {cfg.kv_heads} (llama attention), " if cfg.llama else ""
    rank0_print(f"tensor-parallel size T = {T} (the world size), float64; global sizes: batch B = {p['B']}, "
                f"sequence S = {p['S']}, channels C = {p['C']}, heads H = {cfg.n_head}, {kv}{odd}"
                f"F = 4C = {4 * p['C']}" + (", sequence-parallel" if args.sequence_parallel else ""), comm=comm)
    every = True
    for kind in kinds:
        if kind in explain_vocab.LAYERS:
            every &= explain_vocab.lesson(kind, args, comm)
            continue
        ok, text, counted, kept = explain_layer(kind, p, comm, args.sequence_parallel)
        texts = comm.gather(text, root=0)          # a lesson, not a hot path: pickled once
        lesson = (SP_LESSONS if args.sequence_parallel else LESSONS)[kind]
        if cfg.llama and kind in ("attention", "block"):
            lesson += " " + GQA_LESSON.format(H_kv=cfg.kv_heads, H=cfg.n_head, R=cfg.n_head // cfg.kv_heads)
        same = ""
        if args.sequence_parallel and T > 1:
            equal, same, kept_plain = sp_versus_tp(kind, p, comm, counted)
            ok &= equal
            same = "\n" + same + (memory_line(p, T, kept, kept_plain) if kind == "block" else "")
        rank0_print(f"\n== {kind} ==\n{textwrap.fill(lesson, 100)}\n" + "\n".join(texts or []) + same +
                    f"\n{kind}: all ranks equal the serial layer: {'yes' if ok else 'no'}", comm=comm)
        every &= ok
    if len(kinds) > 1:
        rank0_print(f"\nevery layer: all ranks equal the serial layer: {'yes' if every else 'no'}", comm=comm)
    return every


def add_parser(sub) -> None:
    e = sub.add_parser("explain", help="a live lesson: one tiny layer split over the ranks, against its serial self",
                       description=__doc__.split("\n\n")[0])
    e.add_argument("--layer", choices=LAYERS + explain_vocab.LAYERS + ("all", "pipeline", "moe", "step", "cp",
                                                                       "precision"),
                   default="mlp",
                   help="the layer to show (default mlp); embedding, loss: the vocabulary split; pipeline: the "
                        "schedules on P = world size stages, drawn from the run's own timestamps; moe: a "
                        "mixture-of-experts layer at ep = world size; step: one training step of a tiny GPT; "
                        "cp: ring attention at cp = world size (context parallelism); precision: a block's "
                        "activation bytes and the state per parameter at bf16 beside fp32 (explain/precision.py)")
    e.add_argument("--features", type=int, default=8, help="channels C (default 8)")
    e.add_argument("--heads", type=int, default=None,
                   help="attention heads (default: the fewest, at least 2, that divide C and give every rank one; "
                        "with --layer cp, where the ranks split the sequence, the fewest, at least 2, dividing C)")
    e.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads H_kv dividing the heads: grouped-query attention, the attention (and "
                        "block) of a Llama model; shows which key/value heads each rank holds, split or "
                        "replicated (default: none, GPT-2's multi-head attention)")
    e.add_argument("--batch", type=int, default=2, help="batch B (default 2)")
    e.add_argument("--seq", type=int, default=None, help="sequence length S (default 4; with --layer cp 4N)")
    e.add_argument("--sequence-parallel", action="store_true", help="split the activations along the sequence")
    e.add_argument("--micro-batches", type=int, default=None,
                   help="with --layer pipeline: micro-batches per step (default 2 P); with --layer step: per "
                        "replica (default P)")
    explain_vocab.add_arguments(e)
    explain_moe.add_arguments(e)
    explain_step.add_arguments(e)
    e.set_defaults(run=cmd_explain)


def cmd_explain(args, comm) -> int:
    return 0 if run(args, comm) else 1
