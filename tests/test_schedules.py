"""Pipeline schedules as data (mpi_tp.parallel.pipeline.schedules): every forward before its backward,
the dependencies between stages hold (the simulation never deadlocks), the in-flight bounds of each
schedule, and the simulated bubble equals the closed forms (P - 1) / M and (P - 1) / (v M)."""
import pytest

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.pipeline.schedules import Action, check, draw, in_flight, schedule, simulate

SIZES = [(P, M) for P in (1, 2, 3, 4) for M in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("P,M", SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_valid_and_bubble_is_the_closed_form(name, P, M):
    plan = schedule(name, P, M)
    check(plan, M)
    sim = simulate(plan, 1.0, 2.0)
    assert sim["time"] == pytest.approx((M + P - 1) * 3.0)
    assert sim["bubble"] == pytest.approx((P - 1) / M)


@pytest.mark.parametrize("P,M", SIZES)
def test_in_flight_bounds(P, M):
    assert [in_flight(a) for a in schedule("gpipe", P, M)] == [M] * P                      # GPipe: all M
    assert [in_flight(a) for a in schedule("1f1b", P, M)] == [min(P - s, M) for s in range(P)]   # at most P


@pytest.mark.parametrize("P,V", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_interleaved(P, V, groups):
    M = groups * P
    plan = schedule("interleaved", P, M, V)
    check(plan, M)
    sim = simulate(plan, 1.0 / V, 2.0 / V)                   # a chunk holds 1/V of the stage's layers
    assert sim["bubble"] == pytest.approx((P - 1) / (V * M))
    for s, acts in enumerate(plan):                          # Megatron's warm-up, plus the steady one
        assert in_flight(acts) == min((P - s - 1) * 2 + (V - 1) * P + 1, M * V)


def test_one_stage_has_no_bubble():
    for name in ("gpipe", "1f1b"):
        assert simulate(schedule(name, 1, 5))["bubble"] == 0


def test_broken_lists_are_caught():
    plan = schedule("1f1b", 2, 2)
    backward_first = [list(plan[0]), [Action("B", 0)] + [a for a in plan[1] if a != Action("B", 0)]]
    with pytest.raises(ValueError, match="backward before forward"):
        check(backward_first, 2)
    swapped = [plan[0][::-1], plan[1]]                       # stage 0 waits on a backward that waits on it
    with pytest.raises(ValueError):
        check(swapped, 2)
    with pytest.raises(ValueError, match="deadlocks"):
        simulate([[Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
                  [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]][::-1])
    with pytest.raises(ValueError, match="once"):
        check([plan[0][:-1], plan[1]], 2)


def test_bad_requests_are_user_errors():
    with pytest.raises(UserError, match="multiple of the 4 pipeline stages"):
        schedule("interleaved", 4, 6, 2)
    with pytest.raises(UserError, match="needs --schedule interleaved"):
        schedule("1f1b", 2, 4, 2)
    with pytest.raises(UserError, match="unknown schedule"):
        schedule("zigzag", 2, 4)


def test_drawing_shows_the_warm_up():
    rows = draw(schedule("1f1b", 4, 8)).splitlines()
    assert rows[0].startswith("stage 0: 0123") and rows[3].startswith("stage 3: ...0aa1bb")


@pytest.mark.parametrize("n,P,V", [(3, 2, 1), (70, 12, 1), (4, 4, 1), (7, 2, 2), (12, 3, 2), (5, 1, 1)])
def test_layer_ranges_cover_the_model_in_order(n, P, V):
    from mpi_tp.parallel.pipeline.stages import layer_ranges
    ranges = layer_ranges(n, P, V)
    by_chunk = sorted((v * P + s, r) for s in range(P) for v, r in enumerate(ranges[s]))
    blocks = [b for _, r in by_chunk for b in r]
    assert blocks == list(range(n))                                   # each block once, in model order
    sizes = [len(r) for _, r in by_chunk]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)   # extra blocks in front
    if (n, P) == (70, 12):
        assert sizes == [6] * 10 + [5] * 2
    if (n, P) == (3, 2):
        assert ranges == [[range(0, 2)], [range(2, 3)]]


def test_too_few_layers_is_a_user_error():
    from mpi_tp.parallel.pipeline.stages import layer_ranges
    with pytest.raises(UserError, match="cannot fill 4 pipeline stages x 2 chunks"):
        layer_ranges(7, 4, 2)
