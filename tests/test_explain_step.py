"""`mpi-tp explain --layer step`: one training step through the training code, at every layout that fits the
world size of the run (1, 2, 3, 4 ranks): every rank equals the serial step (loss, gradient norm, weights
after the update), and each phase shows the collectives the model's structure predicts, with wire bytes
by the closed forms. A broken collective makes the lesson fail; bad options are one-line usage errors.
"""
import re

import pytest
from jobs import mpirun
from test_explain import explain, needs_mpiexec, one_rank_pass
from test_explain_vocab import off_by_a_millionth

from mpi_tp.core.errors import UserError

MPI_TEST = pytest.mark.mpi(min_size=1)
B, S, C, L, V = 2, 4, 8, 2, 256
BSC = B * S * C * 8                                  # one (B, S, C) float64 activation
ENTRY = re.compile(r"^    (\w+)/(\w+): (\d+) calls?, (\d+) buffer bytes, (\d+) wire bytes", re.MULTILINE)
# name: (options, world sizes where it applies)
LAYOUTS = {
    "tp": ([], lambda W: True),
    "sp": (["--sequence-parallel"], lambda W: True),
    "dp2": (["--dp", "2"], lambda W: W % 2 == 0),
    "pp2": (["--pp", "2"], lambda W: W % 2 == 0),
    "moe": (["--moe-experts", "4", "--dp", "{W}", "--ep", "{W}"], lambda W: True),
    "pp2-dp2": (["--pp", "2", "--dp", "2"], lambda W: W == 4),
    "sp-pp2": (["--sequence-parallel", "--pp", "2"], lambda W: W == 4),
    "moe-tp2": (["--moe-experts", "4", "--dp", "2", "--ep", "2"], lambda W: W == 4),
    "moe-sp": (["--moe-experts", "4", "--sequence-parallel"], lambda W: W > 1),
    "moe-pp2": (["--moe-experts", "4", "--pp", "2"], lambda W: W == 2),
}


def step(capsys, world, options):
    """Run the lesson with `options` (given as on the command line) in this job; rank 0's parsed output."""
    over, i = {}, 0
    while i < len(options):
        key = options[i][2:].replace("-", "_")
        if key == "sequence_parallel":
            over[key], i = True, i + 1
            continue
        over[key], i = int(options[i + 1].format(W=world.Get_size())), i + 2
    status, out = explain(capsys, world, "step", **over)
    return status, out


def parse(out):
    """[{phase: {(group, kind): (calls, buffer bytes, wire bytes)}}, ...] per rank, and each rank's text."""
    ranks = []
    for text in out.split("\n-- rank ")[1:]:
        phases, current = {}, None
        for line in text.splitlines()[1:]:
            head = re.match(r"^  ([a-z ]+):( none)?$", line)
            if head:
                current = phases.setdefault(head[1], {})
            m = ENTRY.match(line)
            if m and current is not None:
                current[(m[1], m[2])] = tuple(int(v) for v in m.groups()[2:])
        ranks.append((phases, text))
    return ranks


def ring(kind, n, G):
    reduce = "all_reduce" in kind or kind in ("routing_sums", "expert_counts", "etp_reduce")   # the MoE's sums
    return round((2 if reduce else 1) * (G - 1) / G * n)


def ar(calls, n, T):
    """(calls, bytes, wire) of `calls` all-reduces of n bytes in all over T ranks."""
    return calls, n, ring("all_reduce", n, T)


def tp_phases(T, sp):
    """What the dense blocks and the vocabulary split move over tp in one step of the whole model."""
    if T == 1:
        return {"embedding": {}, "blocks": {}, "loss": {}, "backward": {}, "gradient norm": {}}
    if not sp:
        return {"embedding": {("tp", "all_reduce"): ar(1, BSC, T)},
                "blocks": {("tp", "all_reduce"): ar(2 * L, 2 * L * BSC, T)},
                "loss": {("tp", "all_reduce"): ar(2, 3 * B * S * 8, T)},
                "backward": {("tp", "all_reduce"): ar(2 * L + 1, (2 * L + 1) * BSC, T)},
                "gradient norm": {("tp", "all_reduce"): ar(1, 8, T)}}
    half = lambda calls, kind: (calls, calls * BSC, ring(kind, calls * BSC, T))
    return {"embedding": {("tp", "reduce_scatter"): half(1, "reduce_scatter")},
            "blocks": {("tp", "all_gather"): half(2 * L, "all_gather"),
                       ("tp", "reduce_scatter"): half(2 * L, "reduce_scatter")},
            "loss": {("tp", "all_gather"): half(1, "all_gather"), ("tp", "all_reduce"): ar(2, 3 * B * S * 8, T)},
            "backward": {("tp", "all_gather"): half(2 * L + 1, "all_gather"),
                         ("tp", "regather"): half(2 * L + 1, "regather"),    # q/k/v, fc, the output layer
                         ("tp", "reduce_scatter"): half(2 * L + 1, "reduce_scatter")},
            "gradient norm": {("tp", "all_reduce"): ar(1, 8, T)}}


def group(phase, name):
    return {k: v for k, v in phase.items() if k[0] == name}


@MPI_TEST
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_equals_the_serial_step(capsys, world, layout):
    options, fits = LAYOUTS[layout]
    W = world.Get_size()
    if not fits(W):
        pytest.skip(f"{layout} does not fit {W} ranks")
    status, out = step(capsys, world, options)
    assert status == 0
    if world.Get_rank() != 0:
        assert out == ""
        return
    assert "step: every rank equals the serial step: yes" in out and "FAIL" not in out, out
    ranks = parse(out)
    assert len(ranks) == W and out.count("tolerance 1e-10: PASS") == W
    D = int(options[options.index("--dp") + 1].format(W=W)) if "--dp" in options else 1
    P = 2 if "--pp" in options else 1
    T, sp, moe = W // (D * P), "--sequence-parallel" in options, "--moe-experts" in options
    for phases, text in ranks:
        assert "wire bytes = closed forms (G: the group's size, n: the buffer bytes): yes" in text
        assert list(phases)[:3] == ["embedding", "blocks", "loss"] and list(phases)[-2:] == ["gradient norm",
                                                                                            "optimizer"]
        assert phases["optimizer"] == {}                  # SGD: elementwise on each rank's shards
        for ph in phases.values():                        # the wire bytes of every entry, by its closed form
            for (g, kind), (_, n, wire) in ph.items():
                G = {"tp": T, "dp": D, "pp": P, "ep": D, "emb": 2}[g]
                assert wire == (n if kind in ("send", "all_to_all", "all_to_allv") else
                                0 if kind in ("recv", "broadcast") else ring(kind, n, G)), (g, kind, text)
        if P == 1 and not moe:                            # the whole dense model on every rank
            want = tp_phases(T, sp)
            for name, expect in want.items():
                got = group(phases[name], "tp")
                if sp and name == "backward" and T > 1:     # once per bucket: the blocks', the rest's (8 MiB)
                    assert got.pop(("tp", "sp_grad_all_reduce"))[0] == 2
                assert got == expect, (name, got, text)
        if D > 1:
            assert phases["loss to every rank"][("dp", "all_reduce")] == ar(1, 8, D)
            assert phases["backward"][("dp", "iall_reduce")][0] >= 1
        if P > 1:
            M = P
            rows = BSC // T             # its 1/T of the activation (sp: its S_i positions; S = 4 splits evenly)
            if T > 1 and not sp:        # the receiving stage's tp ranks gather the pieces (scatter/gather)
                assert phases["stage to stage"][("tp", "all_gather")][:2] == (M, M * BSC), text
            assert phases["stage to stage"][("pp", "send")][:2] == (M, M * rows), text
            assert phases["stage to stage"][("pp", "recv")][:2] == (M, M * rows), text
            assert phases["loss to every rank"][("pp", "all_reduce")] == ar(1, 8, P)   # + every stage's MoE terms
            assert phases["gradient norm"][("pp", "all_reduce")] == (1, 8, 8)
            assert phases["backward"][("emb", "embedding_all_reduce")][:2] == (1, V // T * C * 8)   # V_i rows
        if moe and D > 1:
            assert phases["blocks"][("ep", "all_to_all")][0] == 1 and phases["blocks"][("ep", "all_to_allv")][0] == 2
            assert phases["backward"][("ep", "all_to_allv")][0] == 2
            assert phases["gradient norm"][("ep", "all_reduce")] == ar(1, 8, D)


@MPI_TEST
def test_a_broken_collective_fails_the_step(capsys, world, monkeypatch):
    if world.Get_size() == 1:
        pytest.skip("one rank: no collective to break")
    off_by_a_millionth(monkeypatch)
    status, out = explain(capsys, world, "step")
    assert status == 1
    if world.Get_rank() == 0:
        assert "FAIL" in out and "step: every rank equals the serial step: no" in out


@MPI_TEST
def test_bad_step_options_are_usage_errors(capsys, world):
    W = world.Get_size()
    with pytest.raises(UserError, match="--dp must be a positive integer, got 0"):
        explain(capsys, world, "step", dp=0)
    with pytest.raises(UserError, match=f"needs {W + 1} MPI ranks but the job has {W}"):
        explain(capsys, world, "step", dp=W + 1)
    with pytest.raises(UserError, match="--pp applies to --layer step only"):
        explain(capsys, world, "mlp", pp=1)
    with pytest.raises(UserError, match="trains on bytes"):
        explain(capsys, world, "step", vocab=9)
    assert capsys.readouterr().out == ""




@needs_mpiexec
@one_rank_pass
@pytest.mark.parametrize("args,message", [
    (["--dp", "3"], "needs 3 MPI ranks but the job has 2"),
    (["--moe-experts", "4", "--ep", "3"], "--ep 3 x --etp 2 = 6 must divide tp x cp x dp = 2"),
])
def test_the_command_refuses_in_one_line(args, message):
    r = mpirun(2, "explain", "--layer", "step", *args, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("mpi-tp: error:") == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""
