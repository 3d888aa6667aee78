"""The cost model's zero-bubble schedules and ZeRO-2/3 against closed forms, and where the planner offers them."""
import pytest

from mpi_tp.core.errors import UserError
from mpi_tp.planning.bubble import bubble_fraction, forward_hops
from mpi_tp.planning.costmodel import Plan, Workload, ring_all_gather, step_time
from mpi_tp.planning.machines import PRESETS, Machine
from mpi_tp.planning.planner import candidates


def cpu(**over):
    base = {"name": "test", "ranks_per_node": 64, "gemm_flops": 1e11, "elem_rate": 1e9, "mem_bw": 1e10,
            "mem_bytes": 1e10, "intra_alpha": 1e-5, "intra_bw": 1e10, "inter_alpha": 1e-4, "inter_bw": 1e9}
    return Machine(**{**base, **over})


W = Workload(n_layer=8, n_embd=256, n_head=4, seq=64, global_batch=32, vocab=256)


def test_bubble_fractions_in_closed_form():
    """Qi et al. 2024: at t_F = t_B = t_W (w = 1/3) ZB-H1 idles a third of 1F1B's (P-1)/M, ZB-V nothing; a W
    share of 0 (nothing to defer) leaves ZB-H1 at 1F1B's and ZB-V at the V's halved chunks; one stage: none."""
    for p, m in ((2, 4), (4, 8), (8, 16)):
        assert bubble_fraction(None, p, 1, m, 1 / 3) == (p - 1) / m
        assert bubble_fraction(None, p, 2, m, 1 / 3) == (p - 1) / (2 * m)
        assert bubble_fraction("zb-h1", p, 1, m, 1 / 3) == pytest.approx((p - 1) / (3 * m))
        assert bubble_fraction("zb-v", p, 2, m, 1 / 3) == pytest.approx(0.0, abs=1e-15)
        assert bubble_fraction("zb-h1", p, 1, m, 0.0) == (p - 1) / m
        assert bubble_fraction("zb-v", p, 2, m, 0.0) == (p - 1) / (2 * m)
        assert bubble_fraction("zb-h1", p, 1, m, 0.2) == pytest.approx((p - 1) * 0.6 / m)
        assert bubble_fraction("zb-v", p, 2, m, 0.5) == 0.0                   # a longer W than F + B: no idle
    assert bubble_fraction("zb-v", 1, 2, 4, 0.1) == 0.0
    # hops of one micro-batch's forward: P v - 1 chunk boundaries; the V keeps chunks P-1 and P on one rank
    assert [forward_hops(s, 4, v) for s, v in ((None, 1), (None, 2), ("zb-h1", 1), ("zb-v", 2))] == [3, 7, 3, 6]


def test_the_w_share_is_the_dw_gemms():
    """W = the dW GEMMs, one pass of the layers' 12 C^2 weights and the head's C V per token: of a GEMM-only
    stage's work 3 passes of those and of attention's Q K^T and A V (no weights: all of their backward is B);
    recomputation adds a forward to B, not to W."""
    m = cpu(ew_rep=0.0, ew_par=0.0, ew_att=0.0, elem_rate=1.0)
    lay = Plan(pp=2, micro_batch=2)
    S, C, V, L = W.seq, W.n_embd, W.vocab, W.n_layer // 2
    layers, head = 2 * 2 * S * 12 * C * C * L, 2 * 2 * S * C * V / 2      # FLOPs of one pass, B = 2 sequences
    attention = 2 * 2 * S * S * C * 2 * L
    assert step_time(m, W, lay)["w_share"] == pytest.approx((layers + head) / (3 * (layers + head + attention)))
    again = step_time(m, W, Plan(pp=2, micro_batch=2, recompute=True))["w_share"]
    assert again == pytest.approx((layers + head) / (4 * (layers + attention) + 3 * head))   # the head: not recomputed


def test_each_schedule_s_bubble_and_messages_in_the_step():
    """step_time's bubble is bubble_fraction of the stage's work (compute + tp comm) at the step's w share;
    the V sends twice 1F1B's messages (pp_overlap 0, so every transfer is priced)."""
    m = cpu()
    base = step_time(m, W, Plan(tp=2, pp=4, micro_batch=1))
    work = base["compute"] + base["tp_comm"]
    M, w = 32, base["w_share"]
    assert base["bubble"] == pytest.approx(3 / M * work)
    h1 = step_time(m, W, Plan(tp=2, pp=4, micro_batch=1, schedule="zb-h1"))
    v = step_time(m, W, Plan(tp=2, pp=4, micro_batch=1, virtual=2, schedule="zb-v"))
    assert h1["bubble"] == pytest.approx(3 * (1 - 2 * w) / M * work) and h1["pp_comm"] == base["pp_comm"]
    assert v["bubble"] == pytest.approx(3 * (1 - 3 * w) / (2 * M) * work)
    assert v["pp_comm"] == pytest.approx(2 * base["pp_comm"])
    assert v["bubble"] < h1["bubble"] < base["bubble"] and h1["compute"] == base["compute"]


def test_zero_stages_move_their_bytes():
    """Over D = 4 with the overlap off: ZeRO-1 a reduce-scatter and an all-gather; ZeRO-2 a reduce-scatter per
    micro-batch (then freed) and the all-gather; ZeRO-3 per micro-batch a reduce-scatter and two all-gathers
    (before the forward and before the backward), each a piece at a time: L + 1 rings (the blocks and the
    embedding), so (L + 1) (D - 1) alpha each instead of (D - 1) alpha. At M = 1: ZeRO-2 = ZeRO-1, and ZeRO-3
    1.5 x ZeRO-1's bytes."""
    m = cpu()
    n = W.params * 4                                              # float32 gradients and weights, tp = pp = 1
    one = ring_all_gather(n, 4, 1e-5, 1e10)
    piecewise = one + (W.n_layer + 1) * 3 * 1e-5                  # 9 rings of 3 steps each, not one
    for M, b in ((1, 8), (4, 2)):
        dp = {z: step_time(m, W, Plan(dp=4, micro_batch=b, zero=z, overlap_dp=False))["dp_comm"] for z in (1, 2, 3)}
        assert dp[1] == pytest.approx(2 * one) and dp[2] == pytest.approx((M + 1) * one), M
        assert dp[3] == pytest.approx(3 * M * piecewise), M
        if M == 1:
            assert dp[2] == pytest.approx(dp[1])
            assert dp[3] == pytest.approx(1.5 * dp[1] + 3 * (W.n_layer + 1) * 3 * 1e-5)   # the bytes, the rings
    shards = [step_time(m, W, Plan(dp=4, zero=z))["optimizer"] for z in (1, 2, 3)]
    assert shards[0] == shards[1] == shards[2] < step_time(m, W, Plan(dp=4))["optimizer"]


def test_zero3_gathers_hide_a_layer_ahead():
    """With the overlap on and compute to spare (dp_overlap 1, a fast link) ZeRO-3's gathers hide but for the
    first layer's of each pass, its reduce-scatters but for the last bucket; with dp_overlap 0 nothing hides."""
    m = cpu(dp_overlap=1.0)
    w = Workload(n_layer=4, n_embd=256, n_head=4, seq=256, global_batch=8, vocab=256)
    lay = Plan(dp=4, micro_batch=1, zero=3)
    t, plain = step_time(m, w, lay), step_time(m, w, Plan(dp=4, micro_batch=1, zero=3, overlap_dp=False))
    n = w.params * 4
    piecewise = ring_all_gather(n, 4, 1e-5, 1e10) + (w.n_layer + 1) * 3 * 1e-5     # L + 1 rings a pass
    gathers, scatters = 2 * 2 * piecewise, 2 * piecewise
    last_bucket = (w.vocab * w.n_embd + w.seq * w.n_embd + 2 * w.n_embd) / w.params
    assert plain["dp_comm"] == pytest.approx(gathers + scatters) and plain["dp_hidden"] == 0
    assert t["dp_hidden"] == pytest.approx(gathers * (1 - 1 / 4) + scatters * (1 - last_bucket))
    assert t["total"] == pytest.approx(plain["total"] - t["dp_hidden"])
    assert step_time(cpu(dp_overlap=0.0), w, lay)["dp_hidden"] == 0


def test_candidates_offer_each_option_where_it_applies():
    """ZeRO 1-3 only where dp x cp > 1; zb-h1 and zb-v only with a pipeline and at least as many micro-batches
    as stages; zb-v only where its 2 P chunks each get a block; a pin keeps one schedule."""
    rows = list(candidates(W, 8, 8, sp=(False,), recomputes=(False,)))
    assert {x.zero for x in rows if x.dp * x.cp > 1} == {0, 1, 2, 3}
    assert {x.zero for x in rows if x.dp * x.cp == 1} == {0}
    for x in rows:
        M = W.global_batch // (x.dp * x.micro_batch)
        if x.schedule:
            assert x.pp > 1 and M >= x.pp and x.virtual == (2 if x.schedule == "zb-v" else 1), x
        if x.schedule == "zb-v":
            assert W.n_layer >= 2 * x.pp, x
    names = {x.schedule_name for x in rows}
    assert names == {"1f1b", "interleaved", "zb-h1", "zb-v"}
    deep = [x for x in rows if x.pp == 8 and x.schedule]                  # 8 stages of 8 blocks: no V (16 chunks)
    assert deep and {x.schedule for x in deep} == {"zb-h1"}
    few = [x for x in rows if x.pp == 4 and x.dp == 2 and x.micro_batch == 8]   # M = 2 < P = 4
    assert few and not any(x.schedule for x in few)
    only = {x.schedule_name for x in candidates(W, 8, 8, schedules=("zb-v",))}
    assert only == {"zb-v"}


def test_layout_words_round_trip():
    """The table's words name the schedule where v would stand; --explain reads them back; a zero-bubble
    schedule without a pipeline is refused in one line."""
    from mpi_tp.commands.plan import parse_layout
    lay = Plan(tp=2, pp=4, dp=2, micro_batch=1, virtual=2, schedule="zb-v", zero=3, sp=True)
    assert lay.describe() == "tp2 pp4 dp2 b1 zb-v +sp +zero3" and lay.schedule_name == "zb-v"
    assert parse_layout(lay.describe(), 16) == lay
    h1 = Plan(pp=2, dp=2, micro_batch=2, schedule="zb-h1", zero=2, recompute=True)
    assert parse_layout(h1.describe(), 4) == h1 and h1.describe() == "tp1 pp2 dp2 b2 zb-h1 +zero2 +recompute"
    with pytest.raises(UserError, match="needs pp > 1"):
        parse_layout("tp1 pp1 dp4 b1 zb-h1", 4)
    assert Plan(pp=2, schedule="zb-v").problems() and not Plan(pp=2, virtual=2, schedule="zb-v").problems()


def test_plan_pins_and_the_config_it_writes(capsys, tmp_path):
    """`mpi-tp plan --schedule zb-h1 --zero 3` prints only those rows; --emit-config writes the fastest layout that
    `mpi-tp train` accepts in this build, and names the faster rows it passed over with train's reason."""
    import argparse
    import json

    from mpi4py import MPI

    from mpi_tp.commands.plan import add_parser, trainable
    from mpi_tp.planning.planner import plan
    from mpi_tp.training.config import TrainConfig
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    model = ["plan", "--machine", "dgx-a100", "--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "256",
             "--global-batch", "32", "--top", "50", "--pp", "2"]
    args = ap.parse_args(model + ["--schedule", "zb-h1", "--zero", "3"])
    assert args.run(args, MPI.COMM_SELF) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[4:6] == "tp"]
    assert rows and all(" zb-h1 " in r and ("+zero3" in r or " dp1 " in r) for r in rows), rows
    out = tmp_path / "best.json"
    args = ap.parse_args(model + ["--emit-config", str(out)])
    assert args.run(args, MPI.COMM_SELF) == 0
    written = json.loads(out.read_text())
    TrainConfig(**written).validate(8)
    w = Workload(8, 512, 8, 256, 32, vocab=51200)                    # the command's model (its default vocabulary)
    best, passed = trainable(w, plan(PRESETS["dgx-a100"], w, 1, pp=2))
    assert best is not None and written["schedule"] == best.schedule_name and written["zero"] == best.zero
    assert all("(" in p for p in passed)              # each passed-over row says why train refused it
