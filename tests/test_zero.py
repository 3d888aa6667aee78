"""ZeRO-2 and ZeRO-3 (FSDP) against the serial model on the same global batch (float64, dropout 0.1, 3 AdamW
steps: first loss < 1e-10, the rest and every weight < 1e-8), at every tp x dp layout of the world (sequence
parallelism at tp > 1), with one and two micro-batches; each run proves its stage ran (the gradient and
parameter bytes a rank holds after the step, the gathers counted, the gathers issued one piece ahead).
Then ZeRO-3's data-parallel bytes against ZeRO-1's (1.5x, closed forms from the parameter count), its
compositions (context parallelism, recomputation), checkpoints saved at one stage and layout loaded at
another, and the refusals (the mpi-tp command at --zero 2 and 3: test_zero_cli.py)."""
import weakref

import numpy as np
import pytest
import steps

from mpi_tp import checkpoint as ck
from mpi_tp.core.testing import all_true, assert_close, gather_full
from mpi_tp.model.chunks import build_stage
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.fsdp import whole_params
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.config import TrainConfig
from mpi_tp.training.optim import AdamW
from mpi_tp.training.step import train_step

pytestmark = pytest.mark.mpi(min_size=1)
CFG = {"vocab_size": 37, "block_size": 7, "n_layer": 2, "n_head": 5, "n_embd": 20}
B, STEPS = 2, 3                     # sequences per micro-batch and replica, steps


def layouts(n):
    """Every (tp, dp) with tp * dp = n."""
    return [(t, n // t) for t in range(1, n + 1) if n % t == 0]


def build(topo, stage, sp=False, recompute="none", dropout=0.1):
    """A model, its reducer at this ZeRO stage (0: none) over dp x cp, and AdamW over them."""
    model = GPT(GPTConfig(**CFG, dropout=dropout), topo, dtype="float64", seed=3, sequence_parallel=sp,
                recompute=recompute)
    reducer = GradReducer(model, topo.dpcp, bucket_mb=0.001, distributed=stage > 0, stage=max(stage, 1))
    return model, reducer, AdamW(model.parameters(), lr=1e-2, reducer=reducer)


def psi(model) -> int:
    """This rank's parameter bytes (its tensor-parallel shards), from the parameters' records."""
    return 8 * sum(int(np.prod(p.global_shape)) // p.global_shape[p.axis] * (p.stop - p.start) if p.sharded
                   else int(np.prod(p.global_shape)) for p in model.parameters())


def weights(model, topo) -> dict:
    """Every compared parameter's full tensor (ZeRO-3: gathered first)."""
    with whole_params(model):
        return {p.name: gather_full(p, topo.tp.comm) for p in steps.compared(model.parameters())}


def moments(opt) -> dict:
    return {f"{k}/{p.name}": a for k, arrays in opt.state_tensors().items() for p, a in zip(opt.params, arrays)}


@pytest.fixture
def serial_reference():
    """The serial model's losses, weights and moments after `n` steps on the global batch of B x M x dp
    sequences in M micro-batches."""
    cache = {}

    def get(dp, M=1, n=STEPS):
        if (dp, M, n) not in cache:
            model, reducer, opt = build(Topology.serial(), 0)
            losses = steps.train(model, opt, n, B * M * dp, micro_batches=M, reducer=reducer)
            cache[dp, M, n] = losses, weights(model, model.topo), moments(opt)
        return cache[dp, M, n]
    return get


def root(a):
    while a.base is not None:
        a = a.base
    return a


def held_bytes(arrays) -> int:
    """The bytes of the distinct buffers behind these arrays (views count their owner once)."""
    return sum({id(root(a)): root(a).nbytes for a in arrays}.values())


def whole_at_most(model, reducer) -> dict:
    """Watch a ZeRO-3 model: {"params", "grads", "alive"}, the most buckets held whole after any of its FSDP's
    calls (filled in as the model runs); "alive" counts the gathered buffers still in memory, whoever keeps
    them (a layer's cache holding its weight would keep a let-go block's alive until its backward)."""
    peak, fsdp, gathered = {"params": 0, "grads": 0, "alive": 0}, model.fsdp, []

    def held(hold):
        def run(full):
            gathered.append(weakref.ref(full))
            hold(full)
        return run
    for b in reducer.buckets:
        b.hold_params = held(b.hold_params)

    def watched(call):
        def run(*piece):
            call(*piece)
            peak["params"] = max(peak["params"], sum(b.params is not None for b in reducer.buckets))
            peak["grads"] = max(peak["grads"], sum(b.grads is not None for b in reducer.buckets))
            peak["alive"] = max(peak["alive"], sum(ref() is not None for ref in gathered))
        return run
    fsdp.forward, fsdp.backward = watched(fsdp.forward), watched(fsdp.backward)
    return peak


def check_close(model, topo, losses, ref, what):
    steps.assert_losses(losses, ref[0], what)
    for name, full in weights(model, topo).items():
        assert_close(full, ref[1][name], 1e-8, f"{name}, {what}")


@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_zero3_equal_serial(world, serial_reference, stage, M):
    for tp, dp in layouts(world.Get_size()):
        topo = Topology.create(world, tp=tp, dp=dp)
        model, reducer, opt = build(topo, stage, sp=tp > 1)
        peak = whole_at_most(model, reducer) if stage == 3 and dp > 1 else None
        losses = steps.train(model, opt, STEPS, B * M, micro_batches=M, reducer=reducer)
        what = f"zero {stage} tp={tp} dp={dp} micro-batches={M}"
        if peak is not None:            # one block and the embedding/head bucket whole at a time, at most
            assert peak == {"params": 2, "grads": 2, "alive": 2}, (peak, what)
        if dp > 1:          # after the step: the gradients' shares only (and ZeRO-3: the parameters' shares)
            shares = sum(b.grad_share.nbytes for b in reducer.buckets)
            whole = sum(p.grad.nbytes for p in model.parameters() if p.grad.size) if stage == 2 else 0
            held = held_bytes([p.grad for p in model.parameters()] + [b.grad_share for b in reducer.buckets])
            assert all_true(held == shares and whole == 0, world), f"{held} gradient bytes held, {what}"
            if stage == 3:
                held = held_bytes([p.data for p in model.parameters()] + [b.param_share for b in reducer.buckets])
                assert all_true(held == sum(b.param_share.nbytes for b in reducer.buckets), world), (held, what)
                gathers = topo.stats.calls["dp/zero3_gather"]
                assert gathers == 2 * M * STEPS * len(reducer.buckets), (gathers, what)
                assert model.fsdp.ahead == gathers - M * STEPS, (model.fsdp.ahead, what)  # all but the first
            else:
                assert held * dp <= psi(model) + 8 * dp * len(reducer.buckets), (held, psi(model), what)
        check_close(model, topo, losses, serial_reference(dp, M), what)
        topo.free()


def wire(snap, kinds) -> float:
    return sum(snap[k]["wire_bytes"] for k in kinds)


def test_zero3_moves_one_and_a_half_times_zero1(world):
    """Per step of M micro-batches, ZeRO-1 (and 2) reduce-scatter the gradients and all-gather the updated
    parameters once: 2 (D-1)/D Psi bytes on the wire of a ring (Psi: this rank's parameter bytes);
    ZeRO-3 gathers every parameter twice a micro-batch and reduce-scatters its gradient once: 3 M (D-1)/D
    Psi, 1.5x at M = 1."""
    for tp, dp in layouts(world.Get_size()):
        if dp == 1:
            continue
        for M in (1, 2):
            moved = {}
            for stage in (1, 2, 3):
                topo = Topology.create(world, tp=tp, dp=dp)
                model, reducer, opt = build(topo, stage, sp=tp > 1, dropout=0.0)
                whole = psi(model)
                x, y = steps.global_batch(0, B * M * dp)
                train_step(model, opt, x, y, topo.replica_rows(B * M), M, reducer=reducer)
                snap = topo.stats.snapshot()
                moved[stage] = wire(snap, ("dp/zero3_gather", "dp/zero3_reduce_scatter") if stage == 3 else
                                    ("dp/reduce_scatter", "dp/all_gather"))
                topo.free()
            ring = whole * (dp - 1) / dp
            what = f"tp={tp} dp={dp} M={M}: {moved}, Psi={whole}"
            assert abs(moved[1] - 2 * ring) <= 1e-9 * ring and moved[2] == moved[1], what
            assert abs(moved[3] - 3 * M * ring) <= 1e-9 * ring, what
            if M == 1:
                assert abs(moved[3] / moved[1] - 1.5) < 1e-12, what


@pytest.mark.mpi(min_size=2)
def test_zero3_composes_with_cp_and_recomputation(world, serial_reference):
    """ZeRO-3 over dp x cp (cp = 2: the context-parallel ranks hold the same weights, so they share them
    out too), and with full and selective recomputation (the recomputed forward runs on the gathered
    parameters of the backward)."""
    n = world.Get_size()
    cases = [({"tp": 1, "cp": 2, "dp": n // 2}, "none")] if n % 2 == 0 else []
    cases += [({"tp": 1, "dp": n}, "full"), ({"tp": 1, "dp": n}, "selective")]
    for shape, recompute in cases:
        topo = Topology.create(world, **shape)
        model, reducer, opt = build(topo, 3, recompute=recompute)
        losses = steps.train(model, opt, STEPS, B, reducer=reducer)
        what = f"zero 3 {shape} recompute={recompute}"
        assert topo.stats.calls["dpcp/zero3_gather" if shape.get("cp") else "dp/zero3_gather"] > 0, what
        check_close(model, topo, losses, serial_reference(shape["dp"]), what)
        topo.free()


@pytest.mark.mpi(min_size=2)
def test_zero3_in_bfloat16_is_zero1_bit_for_bit(world):
    """bf16 parameters and gradients, fp32 masters and moments: at dp 2 and one micro-batch each gradient
    element is the sum of two replicas' values, one rounding whatever the bucket it travels in, and the
    update is elementwise; so ZeRO-3's weights after 3 steps are ZeRO-1's, bit for bit (the gathered
    parameters are the bf16 weights themselves, the masters stay fp32 shares)."""
    n = world.Get_size()
    if n % 2:
        pytest.skip("dp 2 needs an even world")
    runs = {}
    for stage in (1, 3):
        topo = Topology.create(world, tp=n // 2, dp=2)
        model = GPT(GPTConfig(**CFG, dropout=0.1), topo, dtype="bfloat16", seed=3)
        reducer = GradReducer(model, topo.dp, bucket_mb=0.001, distributed=True, stage=stage)
        opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
        steps.train(model, opt, STEPS, B, reducer=reducer)
        assert opt.masters and opt.state["master"][0].dtype == np.float32
        assert (stage == 3) == (topo.stats.calls.get("dp/zero3_gather", 0) > 0)
        with whole_params(model):
            runs[stage] = [p.data.astype(np.float32) for p in model.parameters()]
        topo.free()
    assert all_true(all(np.array_equal(a, b) for a, b in zip(runs[1], runs[3])), world), "bf16 ZeRO-3 != ZeRO-1"


@pytest.mark.mpi(min_size=2)
def test_zero2_and_zero3_compose_with_experts_and_pipelines(world):
    """ZeRO-2 runs where ZeRO-1 does: a pipeline (pp 2 x dp 2, 1F1B over 2 micro-batches) and experts
    (dp = world, each expert's buckets shared out over edp); ZeRO-3 runs the experts too (a MoE block's
    dense and expert buckets gathered together). After 3 steps the weights and gathered moments equal
    the unsharded optimizer's on the same layout (to 1e-12: a reduce-scatter may add in another order
    than an all-reduce), holding only the gradients' shares after each step."""
    n = world.Get_size()
    moe = GPTConfig(**CFG, dropout=0.1, moe_experts=2, moe_capacity=1.0)
    cases = [("experts ep 1", {"tp": 1, "dp": n}, 1)]
    cases += [("experts ep 2", {"tp": 1, "dp": n, "ep": 2}, 1)] if n % 2 == 0 else []
    cases += [("pipeline", {"tp": 1, "pp": 2, "dp": 2}, 2)] if n == 4 else []
    for what, shape, M in cases:
        runs = []
        for stage in (0, 2) if shape.get("pp") else (0, 2, 3):
            topo = Topology.create(world, **shape)
            model = build_stage(GPTConfig(**CFG, dropout=0.1), topo, "float64", 3, micro_batches=M) \
                if shape.get("pp") else GPT(moe, topo, dtype="float64", seed=3)
            reducer = GradReducer(model, topo.dp, bucket_mb=0.001, distributed=stage > 0, stage=max(stage, 1))
            opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
            steps.train(model, opt, STEPS, B * M, micro_batches=M, reducer=reducer)
            held = held_bytes([p.grad for p in model.parameters()] + [b.grad_share for b in reducer.buckets
                                                                       if b.grad_share is not None])
            if stage > 0:
                assert all_true(held == sum(b.grad_share.nbytes for b in reducer.buckets), world), (held, what)
            if stage == 3:                    # every MoE block's expert bucket gathered with its dense one
                assert topo.stats.calls.get("dp/zero3_gather", 0) > 0, what
                assert any(b.group is topo.edp for b in reducer.buckets), what      # the experts' own
            kept = [p for p in steps.compared(model.parameters())]
            with whole_params(model):
                runs.append(([p.data.copy() for p in kept], {k: [a for a, p in zip(arrays, opt.params) if p in kept]
                                                              for k, arrays in opt.state_tensors().items()}))
            topo.free()
        w0, s0 = runs[0]                       # the stages hold different parameters: one verdict for all
        for stage, (w, s) in zip((2, 3), runs[1:]):
            worst = max(float(np.abs(a - b).max()) / max(float(np.abs(a).max()), 1e-30)
                        for a, b in zip(w0 + [a for k in s0 for a in s0[k]], w + [b for k in s for b in s[k]]))
            assert all_true(worst <= 1e-12, world), f"ZeRO-{stage} differs from unsharded by {worst}, {what}"


@pytest.mark.mpi(min_size=2)
def test_zero3_with_pipelines_equals_serial(world):
    """ZeRO-3 under pipelines (pp 1 x v 2 at 2 ranks: both chunks and both copies of wte on one rank; pp 2 x
    dp 2 at 4 under 1F1B, GPipe, the interleaved schedule, ZB-H1 and ZB-V) equals the serial model: each chunk
    gathers its pieces per micro-batch, the copies of the tied table, each a bucket of its own, are summed as
    shares (over the embedding group at pp 2), and under the zero-bubble schedules each piece's reduce-scatter
    waits for the last W writing into it. Proof it ran: the gathers counted, the W's run after their B's
    (weight_calls), only the parameters' and the gradients' shares held after each step."""
    n, M = world.Get_size(), 2
    cases = [("interleaved", 1, 2)] if n == 2 else []                     # (schedule, pp, v)
    cases += [("1f1b", 2, 1), ("gpipe", 2, 1), ("interleaved", 2, 2), ("zb-h1", 2, 1), ("zb-v", 2, 2)] \
        if n == 4 else []
    cfg = GPTConfig(**{**CFG, "n_layer": 4}, dropout=0.1)
    for schedule, pp, v in cases:
        dp, what = n // pp, f"zero 3 {schedule} pp={pp} v={v} dp={n // pp}"
        serial = GPT(cfg, Topology.serial(), dtype="float64", seed=3)
        ref_opt = AdamW(serial.parameters(), lr=1e-2)
        ref = steps.train(serial, ref_opt, STEPS, B * M * dp, micro_batches=M), weights(serial, serial.topo)
        topo = Topology.create(world, tp=1, pp=pp, dp=dp)
        model = build_stage(cfg, topo, "float64", 3, schedule_name=schedule, micro_batches=M, virtual=v)
        reducer = GradReducer(model, topo.dp, bucket_mb=0.001, distributed=True, stage=3)
        opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
        losses = steps.train(model, opt, STEPS, B * M, micro_batches=M, reducer=reducer)
        assert topo.stats.calls["dp/zero3_gather"] > 0, what
        assert (model.weight_calls > 0) == schedule.startswith("zb"), what
        held = held_bytes([p.data for p in model.parameters()] + [b.param_share for b in reducer.buckets])
        assert all_true(held == sum(b.param_share.nbytes for b in reducer.buckets), world), (held, what)
        held = held_bytes([p.grad for p in model.parameters()] + [b.grad_share for b in reducer.buckets])
        assert all_true(held == sum(b.grad_share.nbytes for b in reducer.buckets), world), (held, what)
        steps.assert_losses(losses, ref[0], what)
        worst = {name: float(np.abs(full - ref[1][name]).max() / np.abs(ref[1][name]).max())   # the stages hold
                 for name, full in weights(model, topo).items()}     # different parameters: one verdict for all
        assert all_true(max(worst.values()) <= 1e-8, world), (worst, what)   # both copies of wte: the one table
        topo.free()


def test_checkpoints_load_at_any_stage_and_layout(world, serial_reference, tmp_path_factory):
    """Saved at ZeRO-3 over every rank after 2 steps; loaded serially (zero 0), at ZeRO-2 over every rank
    and at ZeRO-3 at another tp x dp: the weights and moments are the serial run's after 2 steps, and
    the next step's loss is its third."""
    n = world.Get_size()
    root_dir = world.bcast(str(tmp_path_factory.mktemp("zero3")) if world.Get_rank() == 0 else None)
    topo = Topology.create(world, tp=1, dp=n)
    model, reducer, opt = build(topo, 3)
    steps.train(model, opt, 2, B, reducer=reducer)
    ck.save(root_dir, 2, model, opt, {"config": model.cfg.to_dict()})
    topo.free()
    _, ref_weights, ref_moments = serial_reference(n, 1, 2)
    third = serial_reference(n, 1, 3)[0][2]
    tp3 = max(t for t, _ in layouts(n) if t < n) if n > 1 else 1
    for stage, tp, dp in ((0, 1, 1), (2, 1, n), (3, tp3, n // tp3)):
        topo = Topology.serial() if dp * tp == 1 else Topology.create(world, tp=tp, dp=dp)
        model, reducer, opt = build(topo, stage, sp=tp > 1)
        with ck.Checkpoint(root_dir) as c:
            ck.load_into(c, model, opt)
            ck.restore_rng(c, model)                   # the dropout masks of step 3
        what = f"saved at zero 3 dp {n}, loaded at zero {stage} tp={tp} dp={dp}"
        for name, full in weights(model, topo).items():
            assert_close(full, ref_weights[name], 1e-8, f"{name}, {what}")
        for key, a in moments(opt).items():
            if not key.endswith("attn/k/bias"):
                p = next(p for p in opt.params if key.endswith("/" + p.name))
                ref = ref_moments[key][p.index()]
                assert_close(a, ref, 1e-8, f"{key}, {what}", scale=max(np.abs(ref).max(), 1e-30))
        x, y = steps.global_batch(2, B * n)
        loss, _, _ = train_step(model, opt, x, y, topo.replica_rows(B * n // dp), reducer=reducer)
        assert_close(np.array([loss]), np.array([third]), 1e-8, f"the next step's loss, {what}")
        topo.free()


def test_what_zero3_does_not_run_is_one_line():
    """ZeRO-3 refuses the hierarchical all-reduce with what to use instead."""
    cases = {"--dp-allreduce flat": {"dp": 2, "dp_allreduce": "hierarchical"}}
    for hint, options in cases.items():
        with pytest.raises(ConfigError, match=hint) as err:
            TrainConfig(zero=3, **options).validate(2)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="choose one of"):
        TrainConfig(zero=4).validate(1)
