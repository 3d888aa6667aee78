"""`mpi-tp explain --layer cp` at the world size of the run: every option it takes is honoured (the sizes
printed, the ring's bytes those of B, H_kv, hs and S, grouped-query attention equal to the serial kernel),
and every other one, or a sequence it cannot cut into 2Z chunks, is one line (MPI tests, 1 to 4 ranks)."""
import argparse
import re

import pytest

from mpi_tp.commands.explain import add_parser, cmd_explain
from mpi_tp.core.errors import UserError
from mpi_tp.parallel.topology import split_sizes

MPI_TEST = pytest.mark.mpi(min_size=1)


def ring(capsys, world, *argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    status = cmd_explain(parser.parse_args(["explain", "--layer", "cp", *argv]), world)
    return status, capsys.readouterr().out


def ring_bytes(out):
    """Each rank's bytes sent on the group cp, as printed, with the closed form's verdict."""
    return [(int(n), verdict) for n, verdict in re.findall(r"; (\d+) bytes, closed form .*: (\w+)$", out, re.MULTILINE)]


def sent(N, S, B, H_kv, hs):
    """What rank r sends in one layer: Z - 1 K/V blocks forward and backward, Z dK/dV, 2 B H_kv hs 8 bytes each
    position of the block held (rank r - s's two chunks at step s)."""
    sizes = split_sizes(S, 2 * N)
    held = [[sizes[(r - s) % N] + sizes[2 * N - 1 - (r - s) % N] for s in range(N)] for r in range(N)]
    return [2 * B * H_kv * hs * 8 * (2 * sum(h[:N - 1]) + S) if N > 1 else 0 for h in held]


@MPI_TEST
@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_every_size_option_is_honoured(capsys, world, kv_heads):
    """--batch, --features, --heads, --kv-heads and --seq reach the ring (they were fixed at B 2, H 2, hs 4)."""
    N = world.Get_size()
    S = 2 * N + 1                                          # chunks of unequal sizes
    kv = [] if kv_heads is None else ["--kv-heads", str(kv_heads)]
    status, out = ring(capsys, world, "--batch", "3", "--features", "24", "--heads", "4", "--seq", str(S), *kv)
    assert status == 0
    if world.Get_rank() != 0:
        assert out == ""
        return
    H_kv = 4 if kv_heads is None else kv_heads
    assert "B = 3, H = 4 heads of hs = 6" in out and f"S = {S} positions" in out, out
    assert (f"H_kv = {H_kv} key/value heads" in out) == (kv_heads is not None)
    assert ring_bytes(out) == [(n, "equal") for n in sent(N, S, 3, H_kv, 6)], out
    assert "PASS" in out


@MPI_TEST
def test_the_default_sequence_is_4N(capsys, world):
    N = world.Get_size()
    status, out = ring(capsys, world)
    assert status == 0
    if world.Get_rank() == 0:
        assert f"B = 2, H = 2 heads of hs = 4, S = {4 * N} positions in 2Z = {2 * N} chunks" in out, out


@MPI_TEST
@pytest.mark.parametrize("argv,says", [
    (["--sequence-parallel"], "--sequence-parallel does not apply to --layer cp"),
    (["--vocab", "5"], "--vocab does not apply"),
    (["--moe-experts", "2"], "--moe-experts does not apply"),
    (["--micro-batches", "2"], "--micro-batches does not apply"),
    (["--tp", "1"], "--tp does not apply"),
    (["--heads", "3"], "--heads 3 must divide --features 8"),
    (["--heads", "4", "--kv-heads", "3"], "--kv-heads 3 must divide the 4 heads"),
    (["--batch", "0"], "--batch must be a positive integer"),
])
def test_what_it_cannot_do_is_one_line(capsys, world, argv, says):
    with pytest.raises(UserError, match=re.escape(says)):
        ring(capsys, world, *argv)
    assert capsys.readouterr().out == ""                   # nothing printed before the check


@MPI_TEST
def test_a_sequence_shorter_than_2N_is_refused_not_changed(capsys, world):
    N = world.Get_size()
    with pytest.raises(UserError, match=rf"--seq {2 * N - 1} cannot be cut into 2Z = {2 * N} chunks"):
        ring(capsys, world, "--seq", str(2 * N - 1))
    assert capsys.readouterr().out == ""
