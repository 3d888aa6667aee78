"""`mpi-tp explain` at the world size of the run: every layer equals its serial self, the shards are
the split rule's, and the collectives of each pass are Megatron's (f, g, or their sequence-parallel forms).

The in-process tests are MPI tests (1, 2, 3 and 4 ranks); the last one starts its own 2-rank job and
runs in the one-rank pass only, like tests/test_cli.py.
"""
import argparse
import re

import pytest
from jobs import MPIEXEC, mpirun
from mpi4py import MPI

from mpi_tp.commands.explain import add_parser, cmd_explain
from mpi_tp.core.errors import UserError
from mpi_tp.parallel.topology import split_sizes

MPI_TEST = pytest.mark.mpi(min_size=1)
B, S, C = 2, 4, 8
BSC_BYTES = B * S * C * 8                 # one (B, S, C) float64 activation
# layer: (f's or sp all-gathers on the way in, g's or sp reduce-scatters on the way out), per forward
REGIONS = {"column": (1, 0), "row": (0, 1), "mlp": (1, 1), "attention": (1, 1), "block": (2, 2)}


def parse(*argv):
    """The arguments of `mpi-tp explain ARGV`, every default as the command line gives it."""
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["explain", *argv])


def explain(capsys, world, layer="all", sp=False, **over):
    args = parse("--layer", layer, "--features", str(C), "--batch", str(B), "--seq", str(S))
    args.sequence_parallel = sp
    for key, value in over.items():
        setattr(args, key, value)
    status = cmd_explain(args, world)
    return status, capsys.readouterr().out


def sections(out):
    """{layer: [rank 0's text, rank 1's text, ...]} from rank 0's output."""
    found = {}
    for part in out.split("\n== ")[1:]:
        layer = part.split(" ==", 1)[0]
        found[layer] = part.split("-- rank ")[1:]
    return found


def counts(rank_text, phase, T=None):
    """{kind: (calls, buffer bytes)} of the collectives printed for one pass; with T, their printed wire
    bytes are checked against the closed forms (2(T-1)/T n for an all-reduce, (T-1)/T n otherwise)."""
    found = re.findall(rf"^  {phase} +tp/(\w+): (\d+) calls?, (\d+) buffer bytes, (\d+) wire bytes", rank_text,
                       re.MULTILINE)
    for k, _, n, wire in found:
        if T is not None:
            assert int(wire) == round((2 if "all_reduce" in k else 1) * (T - 1) / T * int(n)), (k, n, wire)
    return {k: (int(c), int(b)) for k, c, b, _ in found}


@MPI_TEST
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("layer", list(REGIONS))
def test_every_layer_equals_serial_with_megatrons_collectives(capsys, world, layer, sp):
    status, out = explain(capsys, world, layer, sp)
    assert status == 0
    if world.Get_rank() != 0:
        assert out == ""                              # rank 0 speaks for everyone
        return
    assert f"{layer}: all ranks equal the serial layer: yes" in out and "FAIL" not in out
    lesson = " ".join(out.split(f"== {layer} ==\n", 1)[1].split("-- rank")[0].split())
    if sp:                                            # the text says what the counters show
        assert "sequence parallelism" in lesson and "all-reduce forward" not in lesson, lesson
        assert "all-reduces forward" not in lesson and "one all-reduce each way" not in lesson, lesson
    ranks = sections(out)[layer]
    assert len(ranks) == world.Get_size() and out.count("PASS") == world.Get_size()
    enter, leave = REGIONS[layer]
    if world.Get_size() == 1:
        expect_f, expect_b = {}, {}
    elif not sp:
        expect_f = {"all_reduce": leave}              # g
        expect_b = {"all_reduce": enter}              # f's backward
    else:
        expect_f = {"all_gather": enter, "reduce_scatter": leave}
        expect_b = {"reduce_scatter": enter, "all_gather": leave}
    for text in ranks:
        fwd, bwd = counts(text, "forward", world.Get_size()), counts(text, "backward", world.Get_size())
        if sp and leave and world.Get_size() > 1:     # replicated grads summed over the positions
            assert bwd.pop("sp_grad_all_reduce")[0] == 1
        if sp and enter and world.Get_size() > 1:     # each column layer gathers its kept input shard again
            assert bwd.pop("regather") == (enter, enter * BSC_BYTES), text
        assert fwd == {k: (n, n * BSC_BYTES) for k, n in expect_f.items() if n}, text
        assert bwd == {k: (n, n * BSC_BYTES) for k, n in expect_b.items() if n}, text
    T = world.Get_size()
    if sp and T > 1:       # the same wire bytes as plain TP's all-reduces: 2(T-1)/T n per region and pass
        wire = (enter + leave) * 2 * (T - 1) / T * BSC_BYTES
        assert (f"all-gathers + reduce-scatters in f's and g's places {wire:.1f} = plain tensor parallelism's "
                f"all-reduces {wire:.1f}: the same traffic; plus {enter * (T - 1) / T * BSC_BYTES:.1f} to gather the "
                "column layer's kept input again") in out, out
    else:
        assert "wire bytes per rank" not in out


@MPI_TEST
@pytest.mark.parametrize("layer", ["mlp", "block"])
def test_sequence_parallel_moves_the_wire_bytes_of_plain_tp(capsys, world, layer):
    """Sum the wire bytes each rank prints: sp's all-gathers and reduce-scatters against plain TP's all-reduces
    of the same layer, both passes (each printed number is rounded to a byte: allow one per line)."""
    wire = {}
    for sp in (False, True):
        status, out = explain(capsys, world, layer, sp)
        assert status == 0
        found = re.findall(r"^  (?:forward|backward) +tp/(\w+): \d+ calls?, \d+ buffer bytes, (\d+) wire bytes",
                           out, re.MULTILINE)
        wire[sp] = [int(w) for k, w in found if k not in ("sp_grad_all_reduce", "regather")]
    if world.Get_rank() == 0:
        assert abs(sum(wire[False]) - sum(wire[True])) <= len(wire[True]), wire
        assert (sum(wire[False]) > 0) == (world.Get_size() > 1)


@MPI_TEST
def test_shards_follow_the_split_rule(capsys, world):
    status, out = explain(capsys, world, heads=4)
    assert status == 0
    if world.Get_rank() != 0:
        return
    assert "every layer: all ranks equal the serial layer: yes" in out
    assert f"batch B = {B}, sequence S = {S}, channels C = {C}, heads H = 4" in out
    T, M, F = world.Get_size(), 2 * C + 1, 4 * C
    layers = sections(out)
    for r in range(T):
        m, f, h = split_sizes(M, T)[r], split_sizes(F, T)[r], split_sizes(4, T)[r]
        m0, f0 = sum(split_sizes(M, T)[:r]), sum(split_sizes(F, T)[:r])
        assert f"column/weight: global ({C}, {M}) -> shard ({C}, {m}) = [:, {m0}:{m0 + m}]" in layers["column"][r]
        assert f"row/weight: global ({M}, {C}) -> shard ({m}, {C}) = [{m0}:{m0 + m}, :]" in layers["row"][r]
        assert f"row/bias: global ({C},) -> shard ({C},) = whole (replicated)" in layers["row"][r]
        assert f"input (2, 4, {m}) -> output (2, 4, {C})" in layers["row"][r]
        assert f"mlp/fc/weight: global ({C}, {F}) -> shard ({C}, {f}) = [:, {f0}:{f0 + f}]" in layers["mlp"][r]
        assert f"mlp/proj/weight: global ({F}, {C}) -> shard ({f}, {C})" in layers["mlp"][r]
        assert f"attn/k/weight: global ({C}, {C}) -> shard ({C}, {2 * h})" in layers["attention"][r]
        assert f"h/0/mlp/fc/weight: global ({C}, {F}) -> shard ({C}, {f})" in layers["block"][r]


@MPI_TEST
def test_sequence_parallel_inputs_are_this_ranks_positions(capsys, world):
    status, out = explain(capsys, world, "mlp", sp=True, seq=5)
    assert status == 0
    if world.Get_rank() == 0:
        for r, text in enumerate(sections(out)["mlp"]):
            s = split_sizes(5, world.Get_size())[r]
            assert f"input (2, {s}, {C}) -> output (2, {s}, {C})" in text


@MPI_TEST
def test_impossible_requests_are_usage_errors_on_every_rank(capsys, world):
    with pytest.raises(UserError, match="--features must be a positive integer"):
        explain(capsys, world, features=0)
    T = world.Get_size()
    with pytest.raises(UserError, match="needs a head"):
        explain(capsys, world, "attention", heads=max(T - 1, 3))     # too few heads, or 3 not dividing 8
    if T > 1:
        with pytest.raises(UserError, match="--seq"):
            explain(capsys, world, "block", sp=True, seq=T - 1)
    assert capsys.readouterr().out == ""                              # nothing printed before the check


@MPI_TEST
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_shows_each_ranks_key_value_heads(capsys, world, kv_heads):
    """--kv-heads H_kv: each rank's line names its query and key/value heads as mpi_tp.model.heads splits them
    (replicas when K < T, with their gradient sum in the backward pass), and the layer equals its serial self."""
    from mpi_tp.model.heads import head_layout
    T = world.Get_size()
    status, out = explain(capsys, world, "attention", heads=4, kv_heads=kv_heads, features=16)
    assert status == 0
    if world.Get_rank() != 0:
        return
    layout = head_layout(4, kv_heads, T)
    assert f"heads H = 4, key/value heads H_kv = {kv_heads} (llama attention)" in out and "Grouped-query" in out
    for r, text in enumerate(sections(out)["attention"]):
        assert layout.describe(r) in text
        assert f"attn/k/weight: global (16, {4 * kv_heads}) -> shard (16, {4 * len(layout.kv[r])})" in text
        assert ("kv/kv_grad_all_reduce: 1 call" in text) == (len(layout.replicas(r)) > 1)


@MPI_TEST
def test_kv_heads_that_do_not_fit_are_usage_errors(capsys, world):
    with pytest.raises(UserError, match="--kv-heads 3 does not fit"):
        explain(capsys, world, "attention", heads=4, kv_heads=3, features=16)
    assert capsys.readouterr().out == ""


# Tests that start their own MPI job: only with an mpiexec, and only in the one-rank pass.
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
one_rank_pass = pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts its own MPI job: one-rank pass only")


@needs_mpiexec
@one_rank_pass
def test_explain_command_prints_once():
    r = mpirun(2, "explain", "--layer", "mlp", timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("mlp: all ranks equal the serial layer: yes") == 1
    assert r.stdout.count("-- rank 0 of 2") == 1 and r.stdout.count("-- rank 1 of 2") == 1
    r = mpirun(2, "explain", "--features", "0", timeout=60)
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1


@needs_mpiexec
@one_rank_pass
def test_pipeline_lesson_draws_each_schedule():
    r = mpirun(2, "explain", "--layer", "pipeline", timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("== gpipe ==", "== 1f1b ==", "== interleaved, 2 chunks per stage ==", "== zb-h1 ==",
                 "== zb-v, 2 chunks per stage =="):
        assert r.stdout.count(name) == 1, r.stdout
    assert r.stdout.count("PASS") == 5 and "FAIL" not in r.stdout
    measured = [line for line in r.stdout.splitlines() if line.startswith("  stage ") and len(line) > 60]
    assert len(measured) == 10 and all(set("0123abcd") & set(line) for line in measured)
    assert sum("ABCD" in line or set("ABCD") <= set(line) for line in measured) == 4     # the W's, drawn
    assert "formula (P - 1) / M = 0.250" in r.stdout and "formula (P - 1) / (v M) = 0.125" in r.stdout
    assert "formula (P - 1) / (3M) = 0.083" in r.stdout and "formula (P - 1) / (6M) = 0.042" in r.stdout
    # the bubble is defined once, as notation.md does (idle over compute time), and the ideal drawing's
    # slots give the formula that way: 6 idle of 30 block-time units at M = 4 is 6 / 24, not 6 / 30
    assert r.stdout.count("bubble = idle time / compute time, of the busiest stage") == 1
    assert r.stdout.count("ideal drawing 6 / 24 = 0.250") == 2 and r.stdout.count("ideal drawing 3 / 24 = 0.125") == 1
    assert r.stdout.count("mostly message latency and Python overhead") == 1 and "fall below it" in r.stdout
    losses = re.findall(r"; loss (\S+) vs serial (\S+): PASS", r.stdout)
    assert len(losses) == 5 and len(set(losses)) == 1, losses    # every schedule runs the same model
    r = mpirun(2, "explain", "--layer", "pipeline", "--micro-batches", "0", timeout=60)
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error:") == 1
