"""Cached decoding against the full forward pass, and batched generation against the serial model.

float64, a tiny model whose 5 heads and 37-byte vocabulary split unevenly at 2, 3 and 4 ranks.
"""
import numpy
import pytest
from decoding import count_prefills, full_last, join_step_leave, restarts

from mpi_tp.core.errors import UserError
from mpi_tp.core.testing import all_true
from mpi_tp.inference.decode import Decoder, compaction, window
from mpi_tp.inference.generate import Request, choose, generate
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
CFG = GPTConfig(vocab_size=37, block_size=12, n_layer=2, n_head=5, n_embd=20)


def models(world, seed=3):
    serial = GPT(CFG, Topology.serial(), dtype="float64", seed=seed).eval()
    topo = Topology.create(world, tp=world.Get_size())
    return serial, GPT(CFG, topo, dtype="float64", seed=seed).eval(), topo


def test_cached_logits_equal_the_full_context_at_every_position(world):
    """Every step's logits equal the full forward pass of what the decoder attends to: the whole row
    while it fits, then its window (the last block_size / 2 bytes, growing back to block_size); and the
    prefix came from the cache: a row was prefilled only at the start and when its window started again."""
    serial, model, topo = models(world)
    rng = numpy.random.default_rng(0)
    histories = [list(rng.integers(0, 37, n)) for n in (5, 1, 3)]          # rows of 5, 1 and 3 bytes: each its own columns
    windows = [list(h) for h in histories]
    dec = Decoder(model, len(windows))
    prefilled = count_prefills(dec)
    logits = dec.prefill(windows)
    worst, slides, want = 0.0, 0, len(windows)
    for step in range(2 * CFG.block_size):
        for b, seen in enumerate(windows):
            worst = max(worst, float(numpy.abs(logits[b] - full_last(serial, seen)).max()))
        nxt = rng.integers(0, 37, len(windows))
        for history, i in zip(histories, nxt):
            history.append(int(i))
        windows = [h[-window(len(h), CFG.block_size):] for h in histories]
        slides += any(len(w) < len(h) and len(w) == CFG.block_size // 2 for w, h in zip(windows, histories))
        want += restarts(histories, CFG.block_size)
        logits = dec.step(nxt)
    assert slides >= 2 and dec.cache.lengths.max() <= CFG.block_size
    assert sum(prefilled) == want, f"{sum(prefilled)} rows prefilled, want {want}: a prefix was recomputed"
    assert list(dec.cache.lengths[:len(windows)]) == [len(w) for w in windows]
    assert all_true(worst < 1e-10, world), worst
    topo.free()


def test_rows_join_and_leave_while_others_run(world):
    """Continuous batching's decoder: rows join between steps (a prefill of their own beside the others'
    decoding), leave (the last row takes the slot), and slide past block_size, and every row's logits
    stay those of the full forward pass of its own context, whatever ran beside it."""
    serial, model, topo = models(world)
    plan = {0: [[1, 2, 3, 4, 5]], 2: [[6], [7, 8]], 9: [[9, 9, 9]], 11: [list(range(12))], 20: [[3]]}
    leaving = {6: [0], 10: [1, 2], 19: [0]}
    dec, rows, worst = join_step_leave(model, serial, plan, leaving, 30, numpy.random.default_rng(1))
    assert dec.rows == len(rows) == 2 and max(len(r) for r in rows) > 12
    assert all_true(worst < 1e-10, world), worst
    topo.free()


def test_compaction_moves_only_the_last_rows():
    assert compaction(5, [1]) == [0, 4, 2, 3]
    assert compaction(5, [0, 4]) == [3, 1, 2]
    assert compaction(3, [0, 1, 2]) == [] and compaction(2, []) == [0, 1]


def test_window_depends_on_the_row_alone():
    assert [window(n, 8) for n in range(1, 20)] == [1, 2, 3, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 4]


def uncached_text(model, req: Request) -> bytes:
    """req's text built without the decoder and its rows: each token chosen from the full forward pass of
    the row's window, by a generator seeded with req.seed (no stop, no end-of-sequence: max_tokens of them)."""
    rng, tokens = numpy.random.default_rng(req.seed), list(req.prompt)
    for _ in range(req.max_tokens):
        tokens.append(choose(full_last(model, tokens[-window(len(tokens), CFG.block_size):]), req, rng))
    return bytes(tokens[len(req.prompt):])


def test_text_is_the_serial_models_at_every_size(world):
    """Greedy, and sampled with a fixed seed: the same bytes at every tensor-parallel size, and the bytes
    drawn by the request's own seed (those of the uncached reference; another seed draws others)."""
    serial, model, topo = models(world, seed=5)
    reqs = [Request(bytes([1, 2, 3]), max_tokens=20, temperature=0), Request(bytes([7]), max_tokens=9, top_k=1),
            Request(bytes([2, 9]), max_tokens=16, temperature=0.9, top_p=0.9, seed=11)]
    want = generate(serial, reqs)
    got = generate(model, reqs)
    assert all_true(got == want, world), (got, want)
    assert want == [uncached_text(serial, r) for r in reqs]     # (every rank computes the same: none fails alone)
    reseeded = Request(reqs[2].prompt, 16, reqs[2].temperature, top_p=reqs[2].top_p, seed=12)
    assert uncached_text(serial, reseeded) != want[2]           # the seed matters at these settings
    assert [len(g) for g in got] == [20, 9, 16]
    topo.free()


def test_batched_generation_equals_each_alone(world):
    _, model, topo = models(world, seed=6)
    reqs = [Request(bytes([4, 5, 6, 7, 8]), max_tokens=15, temperature=1.0, seed=1),
            Request(bytes([9]), max_tokens=6, temperature=0.7, top_k=5, seed=2),
            Request(bytes([1, 1]), max_tokens=20, temperature=1.3, top_p=0.8, seed=3, stop=bytes([0])),
            Request(bytes([3]), max_tokens=10, temperature=0.8, seed=4)]    # row 1 leaves first: the last
    alone = [generate(model, [r])[0] for r in reqs]                          # row (3) takes its slot
    together = generate(model, reqs)
    assert all_true(together == alone, world), (together, alone)
    assert len(together[1]) == 6 and (len(together[2]) == 20 or together[2].endswith(bytes([0])))
    assert len(together[3]) == 10 and min(len(together[0]), len(together[2]) + 1) > 6    # (row 1 left first)
    streamed = {}
    generate(model, reqs, on_token=lambda i, b: streamed.setdefault(i, bytearray()).append(b))
    assert all_true([bytes(streamed[i]) for i in range(4)] == together, world)
    topo.free()


def test_sampling_rules():
    logits = numpy.log(numpy.array([0.5, 0.3, 0.15, 0.05]))
    rng = numpy.random.default_rng(0)
    assert choose(logits, Request(b"x", temperature=0), rng) == 0
    top2 = {choose(logits, Request(b"x", temperature=1.0, top_k=2), rng) for _ in range(200)}
    assert top2 == {0, 1}
    nucleus = {choose(logits, Request(b"x", temperature=1.0, top_p=0.75), rng) for _ in range(200)}
    assert nucleus == {0, 1}                                  # 0.5 + 0.3 reaches 0.75: the smallest such set
    assert {choose(logits, Request(b"x", temperature=1.0, top_p=0.5), rng) for _ in range(50)} == {0}
    cold = {choose(logits, Request(b"x", temperature=0.02), rng) for _ in range(200)}
    assert cold == {0}                                        # weights 0.5^50 : 0.3^50 ...: the next 8e-12 as likely


@pytest.mark.parametrize("bad, says", [
    (dict(prompt=b""), "prompt must hold 1 to 12 tokens"),
    (dict(prompt=bytes(13)), "prompt must hold 1 to 12 tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(seed=-1), "seed must be an integer from 0 to 2\\^64 - 1"),
    (dict(stop=(b"",)), "stop must be non-empty"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_bad_requests_say_what_is_wrong(bad, says):
    req = Request(**{"prompt": b"ab", **bad})
    with pytest.raises(UserError, match=says):
        req.check(CFG.block_size)


def test_decoder_refuses_sequence_parallel_models(world):
    topo = Topology.create(world, tp=world.Get_size())
    with pytest.raises(UserError, match="plain tensor parallelism"):
        Decoder(GPT(CFG, topo, dtype="float64", sequence_parallel=True), 1)
    topo.free()


def test_decoder_lays_the_linear_weights_out_out_in_and_the_model_is_not_trained_after():
    """The Decoder stores each linear weight (out, in) (store_out_in): same values and shapes, fused q/k/v
    still views of one storage, the embedding and LayerNorms untouched; an optimizer then refuses the model
    (it updates flat views of C-ordered storages), rather than update copies."""
    from mpi_tp.core.params import storages, store_out_in
    from mpi_tp.training.optim import AdamW
    model = GPT(CFG, Topology.serial(), dtype="float64", seed=2)
    before, n_storages = {p.name: p.data.copy() for p in model.parameters()}, len(storages(model.parameters()))
    Decoder(model, 2)
    for p in model.parameters():
        numpy.testing.assert_array_equal(p.data, before[p.name])
        assert p.data.flags.c_contiguous == (p.name in ("wte", "wpe") or p.data.ndim == 1), p.name
    qkv = [p for p in model.parameters() if p.name.startswith("h/0/attn/") and p.name.endswith("/weight")]
    assert {id(p.base) for p in qkv[:3]} == {id(qkv[0].base)} and qkv[0].base.T.flags.c_contiguous
    assert all(numpy.shares_memory(p.data, p.base) for p in qkv)
    assert store_out_in(model.parameters()) == 0                 # once is all: nothing left to lay out
    assert len(storages(model.parameters())) == n_storages
    with pytest.raises(UserError, match="laid out .out, in. for decoding"):
        AdamW(model.parameters(), lr=1e-3)

