"""Sliding-window attention (GPTConfig.sliding_window, W: query t sees keys t - W < s <= t; mpi_tp.core.attention_span).

The kernels against a reference written here from the rule alone (a full (S, S) band of -inf and a plain
softmax, float64): the dense, blocked and online forms at windows 1 ... S and none, with uneven tiles and a
dropout mask; their gradients against finite differences. Ring attention with a window equals the serial
kernel at every cp size of the pass. The model: a window of S or more changes nothing, a window of 1 makes
each position attend to itself alone (the output is v), and a windowed model trains at tp, cp and with the
online softmax to the serial model's numbers (float64, 3 AdamW steps with dropout).
"""
import numpy as np
import pytest
import steps as steps_helper

from mpi_tp.core import kernels_attention as ka
from mpi_tp.core import kernels_online as ko
from mpi_tp.core.testing import assert_close, gather_full
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.context_parallel import ContextSplit
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.ring_attention import ring_backward, ring_forward
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import AdamW

S = 13


def reference(q, k, v, window, mask=None, scale=1.0):
    """softmax(q k^T / sqrt(hs) + band) v, the band from the rule (t - W < s <= t), a plain (S, S) computation."""
    t, s = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
    seen = (s <= t) & ((t - s < window) if window is not None else True)
    att = np.where(seen, q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]), -np.inf)
    p = np.exp(att - att.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return ((p if mask is None else p * mask) @ v) * scale


def forms(window):
    return {"dense": lambda q, k, v, m, sc: ka.attention_forward(q, k, v, m, sc, block=64, window=window),
            "blocked": lambda q, k, v, m, sc: ka.attention_forward(q, k, v, m, sc, block=4, window=window),
            "online": lambda q, k, v, m, sc: ko.online_attention_forward(
                q, k, v, None if m is None else (lambda r, c: m[..., r, c]), sc, block=3, window=window)}


BACKWARD = {"dense": ka.attention_backward, "blocked": ka.attention_backward, "online": ko.online_attention_backward}


@pytest.mark.parametrize("window", [1, 2, 4, 5, 12, 13, 40, None])
@pytest.mark.parametrize("dropout", [False, True])
def test_every_form_equals_the_band_reference(window, dropout):
    rng = np.random.default_rng(window or 0)
    q, k, v, dout = (rng.standard_normal((2, 3, S, 4)) for _ in range(4))
    m = rng.random((2, 3, S, S)) > 0.3 if dropout else None
    want = reference(q, k, v, window, m, 1.4 if dropout else 1.0)
    grads = {}
    for name, forward in forms(window).items():
        out, cache = forward(q, k, v, m, 1.4 if dropout else 1.0)
        assert np.abs(out - want).max() < 1e-12, name
        grads[name] = BACKWARD[name](dout, cache)
    for name in ("blocked", "online"):                 # the same gradients by every form (finite differences below)
        for a, b in zip(grads[name], grads["dense"]):
            assert np.abs(a - b).max() < 1e-12, name


@pytest.mark.parametrize("name", ["blocked", "online"])
def test_windowed_gradients_match_finite_differences(name):
    forward = forms(3)[name]
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 9, 3)) for _ in range(3))
    dout = rng.standard_normal((1, 2, 9, 3))
    grads = BACKWARD[name](dout, forward(q, k, v, None, 1.0)[1])
    for x, g in zip((q, k, v), grads):
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            x[i] += 1e-6
            up = float((reference(q, k, v, 3) * dout).sum())
            x[i] -= 2e-6
            down = float((reference(q, k, v, 3) * dout).sum())
            x[i] += 1e-6
            num[i] = (up - down) / 2e-6
        assert np.abs(num - g).max() < 1e-7


def test_a_window_skips_the_tiles_it_cannot_see():
    """With W = 2 and tiles of 3, a strip computes at most two key tiles (and the blocked form's blocks start
    at the window): the work is O(S W), not O(S^2)."""
    tiles = list(ko._tiles(30, 3, 2, np.float64, np))
    assert len(tiles) == 10 + 9 and all(c.start >= r.start - 3 for r, c, _ in tiles)
    assert all(lo >= a - 2 for a, _, lo in ka._blocks(30, 3, 2))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("window", [1, 3, 7, None])
def test_ring_attention_with_a_window_equals_the_serial_kernel(world, window):
    topo = Topology.create(world, tp=1, cp=world.Get_size())
    split = ContextSplit(topo.cp, S)
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((2, 3, S, 4)) for _ in range(4))
    ref, cache = ka.attention_forward(q, k, v, window=window)
    mine = lambda a: split.take(a, axis=2)             # noqa: E731
    out, c = ring_forward(mine(q), mine(k), mine(v), split, window=window)
    assert_close(out, mine(ref), 1e-12, "ring output", comm=world)
    for name, a, b in zip(("dq", "dk", "dv"), ring_backward(mine(dout), c), ka.attention_backward(dout, cache)):
        assert_close(a, mine(b), 1e-12, f"ring {name}", scale=1.0, comm=world)   # (W = 1: dq is 0)
    topo.free()


def cfg(window, dropout=0.1):
    return GPTConfig(vocab_size=37, block_size=12, n_layer=2, n_head=4, n_embd=16, dropout=dropout, arch="llama",
                     n_kv_head=2, intermediate_size=22, sliding_window=window)


def batch(step, rows):
    x = np.random.default_rng([3, step]).integers(0, 37, (rows, 13))
    return x[:, :-1], x[:, 1:]


def losses_of(config, topo=None, steps=3, **kw):
    topo = topo or Topology.serial()
    model = GPT(config, topo, dtype="float64", seed=5, **kw)
    reducer = GradReducer(model, topo.dpcp)                  # (cp: the weights' gradients summed over the ring)
    opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
    return steps_helper.train(model, opt, steps, 2, batch, reducer=reducer), model


def test_the_window_is_the_model_s():
    full, _ = losses_of(cfg(None, 0.0), steps=1)
    assert losses_of(cfg(12, 0.0), steps=1)[0] == full          # W = S: every earlier position, the same bits
    assert losses_of(cfg(4, 0.0), steps=1)[0] != full           # a shorter window changes the loss
    _, model = losses_of(cfg(1, 0.0), steps=0)                   # W = 1: each position attends to itself alone
    attn = model.h[0].attn
    x = np.random.default_rng(0).standard_normal((2, 12, 16))
    q, k, v = attn.project_qkv(x)
    y, _ = ka.attention_forward(*attn.grouped(q, k, v), window=1)
    assert np.abs(attn.ungroup(y) - np.repeat(v, 2, axis=1)).max() < 1e-14
    with pytest.raises(ConfigError, match="llama options"):
        GPTConfig(sliding_window=4).validate(1)


@pytest.mark.mpi(min_size=1)
def test_a_windowed_model_trains_to_the_serial_numbers_at_every_layout(world, monkeypatch):
    """Dense serial reference; tp = n (with sp), cp = n (ring, its masks drawn by tile), and the online softmax
    (ONLINE_FROM lowered to 8) at tp = n: losses and weights within 1e-9."""
    n = world.Get_size()
    ref_losses, ref = losses_of(cfg(5))
    ref = {p.name: p.data for p in ref.parameters()}
    monkeypatch.setattr(ka, "ONLINE_FROM", 8)
    cases = [(dict(tp=n), dict(sequence_parallel=n > 1)), (dict(tp=1, cp=n), {})] if 12 >= 2 * n else []
    for layout, kw in cases + [(dict(tp=n), dict(recompute="selective"))]:
        topo = Topology.create(world, **layout)
        losses, model = losses_of(cfg(5), topo, **kw)
        assert_close(losses, ref_losses, 1e-9, f"losses at {layout} {kw}")
        for p in model.parameters():
            assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-9, f"{p.name} at {layout}")
        topo.free()
