"""The zero-bubble schedules as data (mpi_tp.parallel.pipeline.zero_bubble): every W once, after its B;
the dependencies hold; the simulated step equals the closed forms at equal F, B and W times (ZB-H1:
3M + P - 1, a bubble of (P - 1) / (3M), a third of 1F1B's; ZB-V: 6M + P - 1 chunk units, the last rank's
start only); each stage holds no more than the schedule's bound (1F1B's activation memory); the V
placement puts chunks s and 2P - 1 - s on rank s."""
import pytest

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.pipeline.actions import Action, chunk_owner, global_chunk
from mpi_tp.parallel.pipeline.schedules import (
    check,
    draw,
    held,
    in_flight,
    schedule,
    simulate,
    waiting_weights,
)
from mpi_tp.parallel.pipeline.zero_bubble import v_bound, zb_v

SIZES = [(P, M) for P in (1, 2, 3, 4) for M in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("P,M", SIZES)
def test_zb_h1_is_valid_and_its_bubble_a_third_of_1f1b(P, M):
    plan = schedule("zb-h1", P, M)
    check(plan, M)
    sim = simulate(plan, 1.0, 2.0)                       # B and W one unit each, F one
    if M >= P:                                           # the steady state the formula describes
        assert sim["time"] == pytest.approx(3 * M + P - 1)
        assert sim["bubble"] == pytest.approx((P - 1) / (3 * M))
        assert sim["bubble"] == pytest.approx(simulate(schedule("1f1b", P, M), 1.0, 2.0)["bubble"] / 3)
    for s, acts in enumerate(plan):
        assert in_flight(acts) == min(P - s, M)           # 1F1B's activations between F and B
        assert waiting_weights(acts) <= min(s + 1, M)     # s W's kept back (+ the one just cut)
        assert held(acts) <= min(P, M)                    # F to W: never more than 1F1B's stage 0


TIMES = [(1, 1, 1), (1, 1.25, 0.85), (1, 1.6, 0.7), (1.2, 1.2, 0.8)]      # T_F, T_B, T_W


@pytest.mark.parametrize("P,M", SIZES)
def test_zb_v_is_valid_and_ahead_of_zb_h1(P, M):
    plan = schedule("zb-v", P, M, 2)
    check(plan, M, v_shape=True)
    for acts in plan:
        assert held(acts) <= v_bound(P) == 2 * P + 2       # F to W: 1F1B's 2P chunk micro-batches + 2
    if M >= P > 1:                                        # at every split of the backward measured or assumed
        for t_f, t_b, t_w in TIMES:
            zb_h1 = simulate(schedule("zb-h1", P, M), t_f, t_b + t_w, t_w)["bubble"]
            mine = simulate(plan, t_f, t_b + t_w, t_w, v_shape=True)["bubble"]
            assert mine < zb_h1 or (P, M, t_b) == (4, 16, 1.6), (t_f, t_b, t_w)   # there 0.124 vs 0.108


@pytest.mark.parametrize("P,M", [(P, M) for P, M in SIZES if M >= P])
def test_zb_v_played_at_equal_times_idles_only_at_the_start(P, M):
    plan = zb_v(P, M, (1, 1, 1))
    check(plan, M, v_shape=True)
    assert simulate(plan, 1.0, 2.0, v_shape=True)["time"] == pytest.approx(6 * M + P - 1)   # the last starts at P - 1


def test_every_w_after_its_b_and_missing_ones_are_caught():
    plan = schedule("zb-h1", 2, 3)
    late = [list(plan[0]), [a for a in plan[1] if a != Action("W", 0)]]
    late[1].insert(0, Action("W", 0))                     # W before its B
    with pytest.raises(ValueError, match="runs W before B"):
        check(late, 3)
    with pytest.raises(ValueError, match="W once"):
        check([plan[0], [a for a in plan[1] if a != Action("W", 2)]], 3)


def test_v_placement():
    P = 4
    assert [[global_chunk(s, c, P, True) for c in (0, 1)] for s in range(P)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(chunk_owner(global_chunk(s, c, P, True), P, True) == s for s in range(P) for c in (0, 1))
    from mpi_tp.parallel.pipeline.stages import layer_ranges
    ranges = layer_ranges(9, 2, 2, v_shape=True)           # chunks of 3, 2, 2, 2 blocks in model order
    assert ranges == [[range(3), range(7, 9)], [range(3, 5), range(5, 7)]]


def test_zb_requests():
    with pytest.raises(UserError, match="--virtual-stages 2"):
        schedule("zb-v", 2, 4, 1)
    with pytest.raises(UserError, match="needs --schedule interleaved"):
        schedule("zb-h1", 2, 4, 2)


def test_drawing_shows_w_in_the_cool_down():
    rows = draw(schedule("zb-h1", 4, 8)).splitlines()
    assert rows[0] == "stage 0: 0123...aA4bB5cC6dD7eEfFgGhH"          # stage 0: no W kept back
    assert rows[3].startswith("stage 3: ...0a1b2c3dA4eB") and rows[3].endswith("EFGH")   # 3 W's kept back
