"""`mpi-tp explain --layer embedding` and `--layer loss` at the world size of the run (1, 2, 3 and 4 ranks):
every rank equals the serial layer, holds the rows split_sizes gives it (V = 11: uneven shards), and prints
the collectives the closed forms predict (buffer bytes, wire bytes 2(T-1)/T n or (T-1)/T n); the loss lesson
shows that the max needs no backward. A broken layer makes the lesson fail (the check is live).
"""
import re

import numpy
import pytest
from test_explain import explain

from mpi_tp.core.errors import UserError
from mpi_tp.parallel.collectives import Group
from mpi_tp.parallel.topology import offsets, split_sizes

MPI_TEST = pytest.mark.mpi(min_size=1)
B, S, C, V = 2, 4, 8, 11
N = B * S
LINE = re.compile(r"^  (forward|backward) +tp/(\w+): (\d+) calls?, (\d+) buffer bytes, (\d+) wire bytes", re.MULTILINE)


def ranks_of(out, layer):
    """Rank 0's output, cut into each rank's text of one layer's section."""
    section = out.split(f"\n== {layer} ==\n", 1)[1].split("\n== ", 1)[0]
    return section.split("-- rank ")[1:]


def ring(kind, n, T):
    return round((2 if kind == "all_reduce" else 1) * (T - 1) / T * n)


def printed(text):
    return {(phase, kind): (int(c), int(n), int(w)) for phase, kind, c, n, w in LINE.findall(text)}


@MPI_TEST
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_embedding_lesson(capsys, world, sp):
    status, out = explain(capsys, world, "embedding", sp=sp)
    assert status == 0
    if world.Get_rank() != 0:
        assert out == ""
        return
    T = world.Get_size()
    assert "embedding: all ranks equal the serial layer: yes" in out and "FAIL" not in out
    texts = ranks_of(out, "embedding")
    assert len(texts) == T and out.count("tolerance 1e-10: PASS") == T
    n = N * C * 8
    for r, text in enumerate(texts):
        start, size = offsets(split_sizes(V, T))[r], split_sizes(V, T)[r]
        assert f"wte/weight: global ({V}, {C}) -> shard ({size}, {C}) = [{start}:{start + size}, :]" in text
        assert f"V_i = {size}" in text
        rows = split_sizes(S, T)[r] if sp else S
        assert f"output ({B}, {rows}, {C})" in text
        if T == 1:
            assert printed(text) == {}
        elif sp:
            assert printed(text) == {("forward", "reduce_scatter"): (1, n, ring("reduce_scatter", n, T)),
                                     ("backward", "all_gather"): (1, n, ring("all_gather", n, T))}
        else:
            assert printed(text) == {("forward", "all_reduce"): (1, n, ring("all_reduce", n, T))}
        assert "counted bytes = closed forms: yes" in text


@MPI_TEST
def test_loss_lesson(capsys, world):
    status, out = explain(capsys, world, "loss")
    assert status == 0
    if world.Get_rank() != 0:
        return
    T = world.Get_size()
    texts = ranks_of(out, "loss")
    assert len(texts) == T and out.count("tolerance 1e-10: PASS") == T
    for r, text in enumerate(texts):
        start, size = offsets(split_sizes(V, T))[r], split_sizes(V, T)[r]
        assert f"this rank's columns ({B}, {S}, {size}) = [..., {start}:{start + size}]" in text
        if T == 1:
            assert printed(text) == {}
            continue
        both = 3 * N * 8                                  # max of N values, then sum-exp and target: 2N
        assert printed(text) == {("forward", "all_reduce"): (2, both, ring("all_reduce", both, T))}
        assert f"call 0: tp/all_reduce, {N * 8} buffer bytes, {ring('all_reduce', N * 8, T)} wire bytes" in text
        assert f"call 1: tp/all_reduce, {2 * N * 8} buffer bytes" in text and "MAX of" in text
        assert "backward  none" in text
    assert "the max needs no backward: yes" in out and "Why the max all-reduce has no backward" in out
    same = re.search(r"loss with m_j: ([\d.]+); with m_j \+ c_j .*: ([\d.]+); dlogits differ by ([\d.e+-]+)", out)
    assert same and same[1] == same[2] and float(same[3]) < 1e-12


def off_by_a_millionth(monkeypatch):
    """The mutant: every tensor-parallel all-reduce over more than one rank returns its sum times 1 + 1e-6
    (the serial layers, on one rank, are untouched)."""
    good = Group.all_reduce

    def wrong(self, x, *a, **kw):
        out = good(self, x, *a, **kw)
        if self.size > 1:
            out *= 1 + 1e-6
        return out
    monkeypatch.setattr(Group, "all_reduce", wrong)


@MPI_TEST
@pytest.mark.parametrize("layer", ["embedding", "loss"])
def test_a_broken_collective_fails_the_lesson(capsys, world, monkeypatch, layer):
    if world.Get_size() == 1:
        pytest.skip("one rank: no collective to break")
    off_by_a_millionth(monkeypatch)
    status, out = explain(capsys, world, layer)
    assert status == 1
    if world.Get_rank() == 0:
        assert "FAIL" in out and f"{layer}: all ranks equal the serial layer: no" in out


@MPI_TEST
def test_bad_vocabularies_are_usage_errors(capsys, world):
    with pytest.raises(UserError, match="--vocab must be a positive integer"):
        explain(capsys, world, "loss", vocab=0)
    T = world.Get_size()
    if T > 1:
        with pytest.raises(UserError, match=f"--vocab {T - 1} cannot be split over {T} ranks"):
            explain(capsys, world, "embedding", vocab=T - 1)
    assert capsys.readouterr().out == ""


def test_the_shift_demonstration_alone():
    """What the note computes: moving the max by any c_n changes neither the loss nor dlogits."""
    from mpi_tp.commands.explain.vocab import _max_note, _shifted
    rng = numpy.random.default_rng(0)
    logits, targets = 3 * rng.standard_normal((2, 3, 7)), rng.integers(0, 7, (2, 3))
    lines, same = _max_note(logits, targets)
    assert same and "yes" in lines[-1]
    a, da = _shifted(logits, targets, 0.0)
    b, db = _shifted(logits, targets, numpy.full(6, 40.0))
    assert abs(a - b) < 1e-12 and numpy.abs(da - db).max() < 1e-15
