"""`mpi-tp explain --layer step`: one real training step of a tiny GPT, phase by phase and rank by rank.

    mpiexec -n 2 mpi-tp explain --layer step                            # T = 2
    mpiexec -n 2 mpi-tp explain --layer step --sequence-parallel        # T = 2, sequence parallelism
    mpiexec -n 4 mpi-tp explain --layer step --dp 2                     # T = 2 x D = 2
    mpiexec -n 2 mpi-tp explain --layer step --pp 2                     # P = 2 stages (1F1B, M = 2)
    mpiexec -n 2 mpi-tp explain --layer step --moe-experts 4 --dp 2 --ep 2   # block 1 is an MoE block

The run is the training command's own: `training.build` lays out the ranks
(T = world size / (D P)), builds the model, the SGD optimizer and the batch
sampler (Python's docs as bytes, V = 256), and `training.loop.run_step` runs
step 1: the forward (and backward) of every micro-batch, the data-parallel
gradient all-reduce, the gradient norm and the update. Nothing is computed
twice: the lesson only marks phases around the model's own methods
(explain.common.Phases) and reads the collective counters in each. Rank by rank
it prints every phase's collectives (group/kind, calls, buffer bytes, wire
bytes), checks the wire bytes against their closed forms, and checks the
step's loss, gradient norm and updated weights against the serial model run on
the same global batch (float64, tolerance 1e-10).

SGD, not AdamW: AdamW's first update is lr times the sign of the gradient
(m / sqrt(v) = g / |g|), so the weights after it would hide a wrong gradient;
SGD's update is lr times the gradient itself.
"""
from __future__ import annotations

import numpy

from mpi_tp.commands.explain.common import Phases, comm_text, wire_bytes
from mpi_tp.core.errors import UserError
from mpi_tp.core.runtime import collective_setup, rank0_print
from mpi_tp.core.testing import all_true, max_rel_diff
from mpi_tp.model.config import fewest_heads
from mpi_tp.parallel.layout import Layout
from mpi_tp.parallel.pipeline.stage import PipelineStage
from mpi_tp.training import loop
from mpi_tp.training.build import build_in_scratch
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.optim import lr_at
from mpi_tp.verify.reference import reference

RTOL = 1e-10
SEED = 7
OUTSIDE = "loss to every rank"          # what runs outside the marked phases: the step's loss, made global
PHASES = {
    "embedding": "token lookup in this rank's V_i rows of wte, then g (sp: a reduce-scatter)",
    "blocks": "attention and MLP of each block: one g each (sp: all-gather before, reduce-scatter after; "
              "MoE: the all-to-all of the rows)",
    "loss": "the tied output layer (f; sp: an all-gather) and the vocab-parallel cross entropy (max, then "
            "sum-exp + target logit)",
    "stage to stage": "the activations to the next stage, their gradients back to the previous one: each tp rank "
                      "sends its 1/T of them, the receiving tp ranks all-gather the pieces (sp: each sends its "
                      "S_i positions, nothing to gather)",
    "backward": "the f's (sp: reduce-scatters and all-gathers, replicated gradients summed), the data-parallel "
                "gradient all-reduce, both copies of the tied table summed (pp)",
    OUTSIDE: "the step's loss to every rank (pp: from the last stage; dp: the mean over replicas)",
    "gradient norm": "one all-reduce of the squares of the sharded gradients (tp; ep: experts; pp: stages)",
    "optimizer": "SGD updates each rank's shards elementwise",
}


def add_arguments(e) -> None:
    e.add_argument("--dp", type=int, default=None, help="with --layer step: data-parallel size D (default 1)")
    e.add_argument("--pp", type=int, default=None, help="with --layer step: pipeline stages P (default 1)")
    e.add_argument("--ep", type=int, default=None,
                   help="with --layer step and --moe-experts: expert-parallel size (divides --dp; default 1)")


def refuse_step_options(args) -> None:
    """--dp, --pp and --ep belong to --layer step (the other lessons lay out the ranks themselves)."""
    for flag in ("dp", "pp", "ep"):
        if getattr(args, flag, None) is not None:
            raise UserError(f"--{flag} applies to --layer step only (the other lessons lay out the ranks themselves)")


def plan(args, world: int) -> TrainConfig:
    """The run's configuration (validated by the training code itself: one UserError says what to change)."""
    D, P, ep = (1 if getattr(args, k) is None else getattr(args, k) for k in ("dp", "pp", "ep"))
    E = args.moe_experts or 0
    M = P if args.micro_batches is None else args.micro_batches
    C, B, S = args.features, args.batch, args.seq
    for flag, v in (("--features", C), ("--batch", B), ("--seq", S), ("--dp", D), ("--pp", P), ("--ep", ep),
                    ("--micro-batches", M)):
        if v < 1:
            raise UserError(f"{flag} must be a positive integer, got {v}")
    if args.moe_experts is not None and E < 1:
        raise UserError(f"--moe-experts must be a positive integer, got {E}")
    if getattr(args, "vocab", None) is not None:
        raise UserError("--layer step trains on bytes (V = 256): drop --vocab")
    T = Layout.resolve(world, tp=0, pp=P, dp=D).tp          # T = W / (D P): the world-size rule's own line
    if args.tp is not None and args.tp != T:
        raise UserError(f"--tp {args.tp}: T is the world size / (D P) = {T} here; drop --tp or change -n")
    if C < T:
        raise UserError(f"--features {C} cannot be split over T = {T} ranks: use --features {T} or more")
    H = args.heads or fewest_heads(C, T)
    moe = ({"moe_experts": E, "moe_top_k": args.moe_top_k, "moe_capacity": args.moe_capacity, "moe_every": 2}
           if E else {})                                  # block 1 of 2 is the MoE block
    cfg = TrainConfig(n_layer=max(2, P), n_head=H, n_embd=C, block_size=S, tp=T, pp=P, dp=D, ep=ep,
                      sequence_parallel=args.sequence_parallel, batch_size=B, micro_batches=M, steps=1,
                      optimizer="sgd", lr=0.1, warmup=0, dtype="float64", seed=SEED, sample_len=0, eval_batches=1,
                      eval_every=1, log_every=1, **moe)
    cfg.validate(world)
    return cfg


def instrument(run, phases: Phases) -> None:
    """Mark the phases around the model's own methods (attributes of these instances only)."""
    model = run.model
    chunks = model.chunks if isinstance(model, PipelineStage) else [model]
    for chunk in chunks:
        if chunk.first:
            phases.wrap(chunk.embedding.wte, "forward", "embedding")
        for block in chunk.h:
            phases.wrap(block, "forward", "blocks")
        if chunk.last:
            phases.wrap(chunk.head.table, "logits_forward", "loss")
            phases.wrap(chunk.head.loss, "forward", "loss")
        phases.wrap(chunk, "backward", "backward")
    if isinstance(model, PipelineStage):
        phases.wrap(model.engine, "run", "stage to stage")        # what the chunks leave: sends, receives
        phases.wrap(model.tied_embedding, "sum_grads", "backward")
    phases.wrap(run.reducer, "finish", "backward")
    phases.wrap(run.opt, "grad_norm", "gradient norm")
    phases.wrap(run.opt, "step", "optimizer")


def serial_step(cfg: TrainConfig, run, lr: float) -> tuple[float, float, dict, dict]:
    """The same step on one rank (verify's serial reference of the run): every replica's micro-batches in
    turn, each weighted 1 / (D M) (as the data-parallel mean and gradient accumulation weight them);
    (loss, norm, weights before, after)."""
    ref = reference(run)
    before = {p.name: p.data.copy() for p in ref.model.parameters()}
    x, y = run.sampler.batch(0)
    loss, norm = ref.step(x, y, lr, cfg.grad_clip, micro_batches=cfg.dp * cfg.micro_batches)
    ref.free()
    return loss, norm, before, {p.name: p.data for p in ref.model.parameters()}


def sizes_of(run) -> dict:
    """Group name -> its size G, for the closed forms of the wire bytes."""
    t = run.topo
    out = {g.name: g.size for g in (t.tp, t.pp, t.dp, t.ep, t.edp)}
    tied = getattr(run.model, "tied_embedding", None)
    if tied is not None and tied.group is not None:
        out[tied.group.name] = tied.group.size
    return out


def run_step(cfg: TrainConfig, comm, trace=None) -> dict:
    """Build the run, run step 1 with its phases marked, and check it against the serial step (every rank)."""
    run = build_in_scratch(cfg, comm, "mpi-tp-explain-")
    run.topo.stats.reset()
    phases = Phases(run.topo.stats, OUTSIDE)
    instrument(run, phases)
    lr = lr_at(0, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
    run.topo.stats.trace = trace
    loss, norm, problem = loop.run_step(run, 1, lr)
    run.topo.stats.trace = None
    ref_loss, ref_norm, before, after = serial_step(cfg, run, lr)
    scale = max(float(numpy.abs(after[n] - before[n]).max()) for n in after)       # the largest update
    params = run.model.parameters()
    weights = {p.name: max_rel_diff(p.data, after[p.name][p.index()], scale) for p in params}
    worst = max(weights, key=weights.get)
    G = sizes_of(run)
    formulas = all(round(wire_bytes(k.split("/")[1], v["bytes"], G[k.split("/")[0]]) if v["calls"] else 0)
                   == v["wire_bytes"] for ph in phases.order for k, v in phases.snapshot(ph).items())
    errs = {"loss": abs(loss - ref_loss) / abs(ref_loss), "gradient norm": abs(norm - ref_norm) / ref_norm,
            "weights": weights[worst]}
    ok = problem is None and max(errs.values()) <= RTOL and formulas
    result = {"ok": ok, "loss": loss, "serial_loss": ref_loss, "norm": norm, "serial_norm": ref_norm,
              "errors": errs, "worst": worst, "wire_formulas": formulas, "lr": lr, "update": scale,
              "phases": {ph: phases.snapshot(ph) for ph in PHASES}, "sizes": G,
              "coords": {"rank": comm.Get_rank(), "tp": run.topo.tp.rank, "stage": run.topo.pp.rank,
                         "replica": run.topo.dp.rank, "ep": run.topo.ep.rank}}
    run.topo.free()
    return result


def rank_text(r: dict, cfg: TrainConfig, world: int) -> str:
    c = r["coords"]
    lines = [f"-- rank {c['rank']} of {world}: tp rank {c['tp']}" + (f", stage {c['stage']}" if cfg.pp > 1 else "")
             + (f", replica {c['replica']}" if cfg.dp > 1 else "") + (f", ep rank {c['ep']}" if cfg.ep > 1 else "")
             + " --"]
    for ph in PHASES:
        if ph == "stage to stage" and cfg.pp == 1:
            continue
        snap = r["phases"][ph]
        lines.append(f"  {ph}:" + (" none" if not snap else ""))
        lines += [f"    {comm_text(k, v, r['sizes'][k.split('/')[0]])}" for k, v in snap.items()]
    e = r["errors"]
    lines.append(f"  wire bytes = closed forms (G: the group's size, n: the buffer bytes): "
                 f"{'yes' if r['wire_formulas'] else 'NO'}")
    lines.append(f"  vs serial: loss {r['loss']:.12f} vs {r['serial_loss']:.12f} ({e['loss']:.1e}), gradient norm "
                 f"{r['norm']:.6f} ({e['gradient norm']:.1e}), weights after the update {e['weights']:.1e} (worst "
                 f"{r['worst']}, of the largest update {r['update']:.1e}); tolerance {RTOL:.0e}: "
                 f"{'PASS' if r['ok'] else 'FAIL'}")
    return "\n".join(lines)


def lesson_header(cfg: TrainConfig, world: int) -> str:
    """What the lesson runs: the layout (Layout.describe's words), the model, the batch, the phases."""
    T, D, P = cfg.tp, cfg.dp, cfg.pp
    moe = (f"; block 1 is a mixture of experts: E = {cfg.moe_experts}, top-{cfg.moe_top_k}, ep = {cfg.ep}"
           if cfg.moe_experts else "")
    pipe = f", P = {P} stages (1F1B)" if P > 1 else ""
    return (f"one training step of a tiny GPT on W = {world} rank{'s' * (world > 1)}, layout "
            f"{cfg.layout(world).describe()}: T = {T}, D = {D}{pipe}"
            f"{', sequence-parallel' if cfg.sequence_parallel else ''}{moe}\nL = {cfg.n_layer} blocks, C = "
            f"{cfg.n_embd}, H = {cfg.n_head}, S = {cfg.block_size}, V = 256 (bytes of Python's docs), B = "
            f"{cfg.batch_size} sequences x M = {cfg.micro_batches} micro-batch{'es' * (cfg.micro_batches > 1)} per "
            f"replica; float64; SGD (lr {cfg.lr}, momentum {cfg.momentum}, weight decay {cfg.weight_decay}), "
            f"gradients clipped to norm {cfg.grad_clip}\nphases, in the order they run:\n" +
            "\n".join(f"  {ph}: {text}" for ph, text in PHASES.items() if ph != "stage to stage" or P > 1))


def lesson(args, comm) -> bool:
    """Run the step on every rank and print it from rank 0; True when every rank passed."""
    world = comm.Get_size()
    cfg = collective_setup(plan, args, world, comm=comm)
    r = run_step(cfg, comm)
    texts = comm.gather(rank_text(r, cfg, world), root=0)         # a lesson, not a hot path: pickled once
    every = all_true(r["ok"], comm)
    rank0_print(f"\n== step ==\n{lesson_header(cfg, world)}\n" + "\n".join(texts or []) +
                f"\nstep: every rank equals the serial step: {'yes' if every else 'no'}", comm=comm)
    return every
