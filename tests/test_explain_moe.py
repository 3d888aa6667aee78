"""`mpi-tp explain --layer moe` at 1, 2, 3 ranks (and tp 2 x ep 2 at 4): every rank equals the serial
layer, and the bytes it prints for each collective are what the printed routing table implies, worked
out here from the table alone (rows leaving each rank x C x 8, both directions; the counts exchange).

These tests start their own MPI jobs, so they run in the one-rank pass only (no mpi marker), as the
end-to-end tests of tests/test_explain.py do.
"""
import math
import re

import pytest
from jobs import MPIEXEC, mpirun

from mpi_tp.parallel.topology import split_sizes

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH (pip install mpich)")
C, S = 8, 4
TOKEN = re.compile(r"^  +(\d+) +(\d+) +(\d+)  (e\d+ .*)$", re.MULTILINE)
CHOICE = re.compile(r"e(\d+) ([\d.]+) (kept|DROPPED)")
COUNTED = re.compile(r"^  (forward|backward) +(\w+/\w+): (\d+) calls?, (\d+) buffer bytes, (\d+) wire bytes",
                     re.MULTILINE)


def parse(out, wire_is_buffer=True):
    """Owners of the experts, and per world rank: ep rank, tp rank, routing rows, counted collectives
    (wire_is_buffer: the all-to-all's wire bytes are what it sends; the all-gather dispatcher's are not)."""
    owner = {}
    for r, names in re.findall(r"rank (\d+): ((?:e\d+ ?)+)", out.split("\n", 2)[1]):
        owner.update({int(e): int(r) for e in re.findall(r"e(\d+)", names)})
    ranks = []
    for part in out.split("\n-- rank ")[1:]:
        head = re.match(r"(\d+) of \d+: ep rank (\d+), tp rank (\d+)", part)
        tokens = [(int(n), int(b), int(t), [(int(e), float(g), f == "kept") for e, g, f in CHOICE.findall(rest)])
                  for n, b, t, rest in TOKEN.findall(part)]
        found = COUNTED.findall(part)
        assert not wire_is_buffer or all(int(nb) == int(wire) for *_, nb, wire in found)
        counted = {(phase, key): (int(c), int(nb)) for phase, key, c, nb, _ in found}
        ranks.append({"world": int(head[1]), "ep": int(head[2]), "tp": int(head[3]), "tokens": tokens,
                      "counted": counted, "pass": "tolerance 1e-10: PASS" in part})
    return owner, ranks


def expected(owner, routing, me, j, ep, tp, E, B, k):
    """The counters of ep rank `me`, tp rank j, from the routing tables of every replica (ep rank -> tokens):
    each tp rank sends the rows of the positions it owns (split_sizes(S, tp), as sequence parallelism cuts)."""
    sizes = split_sizes(S, tp)
    mine = range(sum(sizes[:j]), sum(sizes[:j + 1]))
    out = sum(kept and owner[e] != me for _, _, t, picks in routing[me] if t in mine for e, _, kept in picks)
    back = sum(kept and owner[e] == me for s in routing if s != me for _, _, t, picks in routing[s] if t in mine
               for e, _, kept in picks)
    here = sum(kept and owner[e] == me for s in routing for _, _, _, picks in routing[s] for e, _, kept in picks)
    want = {}
    if ep > 1:
        want[("forward", "ep/all_to_all")] = (1, (ep - 1) * max(split_sizes(E, ep)) * 8)
        want[("forward", "ep/all_to_allv")] = want[("backward", "ep/all_to_allv")] = (2, (out + back) * C * 8)
    if tp > 1:    # the whole sequences' routing, the etp group's rows (R = here) gathered and scattered
        want[("forward", "tp/routing")] = (1, B * S * k * 8)
        want[("forward", "tp/routing_sums")] = (1, (B * E + 1) * 8)
        want[("forward", "tp/expert_counts")] = (1, E * 8)
        want[("forward", "tp/etp_counts")] = (1, tp * split_sizes(E, ep)[me] * 8)
        for phase in ("forward", "backward"):
            want[(phase, "tp/etp_gather")] = want[(phase, "tp/etp_reduce")] = (1, here * C * 8)
            want[(phase, "tp/all_gather")] = (1, B * S * C * 8)
    return want


@pytest.mark.parametrize("ranks,extra", [
    (1, []), (2, []), (3, ["--batch", "1"]), (2, ["--moe-top-k", "1", "--moe-capacity", "0", "--moe-experts", "3"]),
    (4, ["--tp", "2", "--batch", "1"]),
], ids=["1", "2", "3-uneven-experts", "2-top1-dropless-E3", "4-tp2-ep2"])
def test_moe_lesson_equals_serial_and_prints_the_counted_bytes(ranks, extra):
    r = mpirun(ranks, "explain", "--layer", "moe", "--features", str(C), "--seq", str(S), *extra, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("moe: all ranks equal the serial layer: yes") == 1 and "FAIL" not in out, out
    E = int(extra[extra.index("--moe-experts") + 1]) if "--moe-experts" in extra else 4
    k = int(extra[extra.index("--moe-top-k") + 1]) if "--moe-top-k" in extra else 2
    tp = int(extra[extra.index("--tp") + 1]) if "--tp" in extra else 1
    B = int(extra[extra.index("--batch") + 1]) if "--batch" in extra else 2
    dropless = "--moe-capacity" in extra
    ep = ranks // tp
    owner, found = parse(out, wire_is_buffer=tp == 1)
    assert len(found) == ranks and all(f["pass"] for f in found)
    sizes = split_sizes(E, ep)                                   # experts split as split_sizes says
    assert [sum(1 for e in owner if owner[e] == r) for r in range(ep)] == sizes
    assert sorted(owner) == list(range(E)) and all(owner[e] <= owner[e + 1] for e in range(E - 1))
    routing = {f["ep"]: f["tokens"] for f in found if f["tp"] == 0}
    assert sorted(routing) == list(range(ep))
    cap = math.ceil(1.0 * S * k / E)
    for me, tokens in routing.items():
        assert [n for n, *_ in tokens] == list(range(me * B * S, (me + 1) * B * S))   # its own sequences
        per_seq = {}
        for _, b, _, picks in tokens:
            assert len(picks) == k and len({e for e, _, _ in picks}) == k
            gates = [g for _, g, _ in picks]
            assert gates == sorted(gates, reverse=True)              # best first
            if k > 1:
                assert abs(sum(gates) - 1) < 2e-3                    # renormalised (3 decimals each)
            for e, _, kept in picks:
                per_seq[b, e] = per_seq.get((b, e), 0) + kept
        if dropless:
            assert all(kept for *_, picks in tokens for _, _, kept in picks)
        else:
            assert max(per_seq.values()) <= cap
    for f in found:
        if f["tp"] > 0:
            assert not f["tokens"] and "those of tp rank 0" in out
        assert f["counted"] == expected(owner, routing, f["ep"], f["tp"], ep, tp, E, B, k), f
    if ranks == 1:
        assert "  forward   none (one rank: every expert is here)" in out
    else:
        assert any(not kept for t in routing.values() for *_, picks in t for _, _, kept in picks) or dropless


def test_moe_lesson_refuses_what_cannot_be_split():
    r = mpirun(3, "explain", "--layer", "moe", "--moe-experts", "2", timeout=60)
    assert r.returncode == 2 and r.stderr.count("mpi-tp: error: --moe-experts 2 cannot be divided") == 1, r.stderr
    r = mpirun(3, "explain", "--layer", "moe", "--tp", "2", timeout=60)
    assert r.returncode == 2 and r.stderr.count("needs 2 MPI ranks but the job has 3") == 1, r.stderr


def test_the_all_gather_dispatcher_prints_its_collectives_and_equals_serial():
    """--moe-dispatcher allgather at 3 ranks (uneven experts): every rank equals the serial layer; each counts
    one all-gather of ep x E counts, an all-gather and a reduce-scatter of every replica's admitted rows
    (worked out here from the printed routing tables) each way, and no all-to-all."""
    r = mpirun(3, "explain", "--layer", "moe", "--moe-dispatcher", "allgather", "--features", str(C), "--seq", str(S),
               timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    _, ranks = parse(out, wire_is_buffer=False)
    assert len(ranks) == 3 and all(rk["pass"] for rk in ranks), out
    admitted = sum(kept for rk in ranks for *_, picks in rk["tokens"] for _, _, kept in picks)
    want = {("forward", "ep/all_gather_counts"): (1, 3 * 4 * 8)}
    for phase in ("forward", "backward"):
        want.update({(phase, "ep/all_gather"): (1, admitted * C * 8), (phase, "ep/reduce_scatter"): (1, admitted * C * 8)})
    assert all(rk["counted"] == want for rk in ranks), (want, [rk["counted"] for rk in ranks])
    assert "all_to_all" not in out and "(all-gather rows and counts)" in out


def gates_of(out):
    """{token: [(expert, gate, kept)]} of every replica's printed routing table, and the printed sum range."""
    _, ranks = parse(out, wire_is_buffer="tp rank 1" not in out)      # tp > 1: gathers, wire = (G-1)/G n
    sums = re.findall(r"gates per token sum to ([\d.]+) \.\. ([\d.]+) \((\S+) router", out)
    return {n: picks for rk in ranks for n, _, _, picks in rk["tokens"]}, sums, ranks


def lesson(*extra, ranks=2):
    r = mpirun(ranks, "explain", "--layer", "moe", "--features", str(C), "--seq", str(S), *extra, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("moe: all ranks equal the serial layer: yes") == 1 and "FAIL" not in r.stdout, r.stdout
    return r.stdout


def test_the_router_options_change_the_printed_gates():
    """softmax without normalisation prints prob_top (the k gates sum to less than 1); topk-softmax picks the same
    experts with those gates divided by their sum; sigmoid's gates are sigmoids, scaled by --moe-gate-scale and
    summing to anything. If explain ignored an option, two of these tables would be the same."""
    raw, raw_sums, _ = gates_of(lesson("--moe-topk-norm", "none"))
    mixtral, mix_sums, _ = gates_of(lesson("--moe-router", "topk-softmax"))
    deepseek, ds_sums, _ = gates_of(lesson("--moe-router", "sigmoid", "--moe-topk-norm", "none", "--moe-gate-scale",
                                           "2.5"))
    assert sorted(raw) == sorted(mixtral) == sorted(deepseek) == list(range(2 * 2 * S))
    for n, picks in raw.items():
        gates = [g for _, g, _ in picks]
        assert sum(gates) < 0.999, (n, picks)                          # two probabilities of four experts
        assert [e for e, _, _ in mixtral[n]] == [e for e, _, _ in picks]   # top-k of z = top-k of softmax(z)
        for (_, g_raw, _), (_, g_mix, _) in zip(picks, mixtral[n]):
            assert abs(g_mix - g_raw / sum(gates)) < 5e-3, (n, picks, mixtral[n])
        assert all(0 < g < 2.5 for _, g, _ in deepseek[n])
    assert any(abs(sum(g for _, g, _ in p) - 1) > 0.1 for p in deepseek.values())
    assert all(float(hi) < 1 and kind == "softmax" for lo, hi, kind in raw_sums) and len(raw_sums) == 2
    assert all(lo == hi == "1.000" and kind == "topk-softmax" for lo, hi, kind in mix_sums)
    assert all(kind == "sigmoid" and float(hi) > 1 for lo, hi, kind in ds_sums)
    scaled, sums, _ = gates_of(lesson("--moe-router", "sigmoid", "--moe-gate-scale", "2.5"))   # k 2: normalised
    assert all(abs(sum(g for _, g, _ in p) - 2.5) < 5e-3 for p in scaled.values())
    assert all(lo == hi == "2.500" for lo, hi, _ in sums)


def test_drop_policy_probs_drops_the_lowest_gates():
    """--moe-drop-policy probs: within a sequence and an expert, no dropped assignment has a higher gate than a
    kept one (by position, later choices go first whatever their gate: the default run shows one that does)."""
    def inversions(table):
        by = {}
        for n, picks in table.items():
            for e, g, kept in picks:
                by.setdefault((n // S, e), []).append((g, kept))
        return sum(1 for v in by.values() for g, kept in v if not kept and any(k and g2 < g for g2, k in v))
    probs, _, _ = gates_of(lesson("--moe-drop-policy", "probs", "--moe-top-k", "2", "--moe-capacity", "0.5"))
    position, _, _ = gates_of(lesson("--moe-top-k", "2", "--moe-capacity", "0.5"))
    assert any(not kept for p in probs.values() for *_, kept in p)
    assert inversions(probs) == 0 and inversions(position) > 0


@pytest.mark.parametrize("ranks,extra", [(2, []), (4, ["--tp", "2", "--batch", "1"])], ids=["ep2", "tp2-ep2"])
def test_shared_experts_equal_serial_and_add_their_own_tp_all_reduce(ranks, extra):
    out = lesson("--moe-shared-experts", "2", *extra, ranks=ranks)
    assert "+ 2 shared experts" in out
    _, _, found = gates_of(out)
    for f in found:
        calls = {key: v[0] for (phase, key), v in f["counted"].items() if phase == "forward"}
        assert calls.get("tp/all_reduce", 0) == (1 if extra else 0), f["counted"]   # the shared experts' g
