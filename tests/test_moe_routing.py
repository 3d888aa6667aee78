"""The routers the models use (mpi_tp.model.routing), on one rank in float64: softmax-then-top-k, Mixtral's
top-k-then-softmax, DeepSeek-V3's sigmoid, normalised and scaled gates, shared experts, dropping by
probability; each layer's backward against finite differences and the forward against values by hand.
(The same options at every layout against the serial model: tests/test_moe.py.)

    python -m pytest -q tests/test_moe_routing.py
"""
import math

import numpy as np
import pytest
from test_moe_layer import SERIAL, fd_check, ffn

from mpi_tp.core.testing import randomize
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.routing import admitted, route, sigmoid
from mpi_tp.parallel.expert_balance import balance_experts, reset
from mpi_tp.training.config import TrainConfig

C = 8


def layer(E, k, capacity=0.0, n_embd=C, **routing):
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=n_embd, moe_experts=E, moe_top_k=k,
                    moe_capacity=capacity, moe_aux_weight=0.3, moe_z_weight=0.2, **routing)
    cfg.validate()
    return MoEMLP("h/0/moe", cfg, SERIAL, "float64", seed=1)


CASES = {
    "softmax-top2-unnormalised": {"k": 2, "moe_topk_norm": "none"},
    "softmax-top1-normalised": {"k": 1, "moe_topk_norm": "sum"},
    "topk-softmax-top2-shared": {"k": 2, "moe_router": "topk-softmax", "moe_shared_experts": 1},
    "sigmoid-top2-scaled-shared-probs": {"k": 2, "capacity": 0.75, "moe_router": "sigmoid", "moe_gate_scale": 2.5,
                                             "moe_shared_experts": 1, "moe_drop_policy": "probs"},
    "sigmoid-top1-unnormalised": {"k": 1, "moe_router": "sigmoid"},
    "softmax-top2-two-shared-probs": {"k": 2, "capacity": 0.75, "moe_shared_experts": 2, "moe_drop_policy": "probs"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_finite_differences(name):
    case = dict(CASES[name])
    m = layer(4, case.pop("k"), case.pop("capacity", 0.0), **case)
    randomize(m, seed=4, std=0.5)
    rng = np.random.default_rng(7)
    x, R = rng.standard_normal((2, 6, C)), rng.standard_normal((2, 6, C))
    choice, keep = fd_check(m, x, R, scale=0.5)
    assert len(np.unique(choice)) == 4
    if m.capacity:
        assert 0 < (~keep).sum() < keep.size, "the capacity should drop some assignments, not all"
    names = {p.name for p in m.parameters()}
    assert any("/shared/" in n for n in names) == bool(case.get("moe_shared_experts"))


def test_topk_softmax_is_softmax_then_topk_normalised():
    """Mixtral's softmax over the k chosen logits equals the softmax router's renormalised top-k (to rounding),
    chooses the same experts, and at k = 1 its gate is 1 (the Switch router's is the probability)."""
    z = np.random.default_rng(0).standard_normal((50, 6)) * 3
    for k in (1, 2, 3):
        a, b = route(z, k, "topk-softmax"), route(z, k, "softmax", "sum")
        assert np.array_equal(a.choice, b.choice)
        assert np.abs(a.gate - b.gate).max() < 1e-15
    assert np.array_equal(route(z, 1, "topk-softmax").gate, np.ones((50, 1)))
    assert (route(z, 1, "softmax").gate < 1).all()


def test_sigmoid_router_by_hand():
    """E = 3, k = 2, logits (0, ln 3, ln 1/3): s = (1/2, 3/4, 1/4), choices (1, 0); gates normalised (3/5, 2/5)
    times 2.5 = (1.5, 1); unnormalised (3/4, 1/2). The aux loss balances p = s / sum s = (1/3, 1/2, 1/6)."""
    z = np.array([[0.0, math.log(3), -math.log(3)]])
    assert np.allclose(sigmoid(z), [[0.5, 0.75, 0.25]], rtol=0, atol=1e-15)
    r = route(z, 2, "sigmoid", "auto", 2.5)
    assert np.array_equal(r.choice, [[1, 0]])
    assert np.abs(r.gate - [[1.5, 1.0]]).max() < 1e-15
    assert np.abs(route(z, 2, "sigmoid", "none").gate - [[0.75, 0.5]]).max() < 1e-15
    assert np.abs(r.p - [[1 / 3, 1 / 2, 1 / 6]]).max() < 1e-15
    assert np.allclose(sigmoid(np.array([-800.0, 800.0])), [0.0, 1.0], rtol=0, atol=0)    # no overflow


def test_an_expert_bias_changes_the_choice_not_the_gate():
    """With a bias on expert 2 large enough to win, the choice moves, and the gate is expert 2's own score."""
    z = np.array([[2.0, 1.0, 0.0]])
    for router in ("softmax", "sigmoid", "topk-softmax"):
        plain, biased = route(z, 1, router, "none" if router != "topk-softmax" else "auto"), \
            route(z, 1, router, "none" if router != "topk-softmax" else "auto", bias=np.array([0.0, 0.0, 5.0]))
        assert plain.choice[0, 0] == 0 and biased.choice[0, 0] == 2, router
        assert np.array_equal(biased.gate, biased.score[:, 2:3] if router != "topk-softmax" else [[1.0]]), router


def test_drop_by_probability():
    """T = 4, E = 2, k = 1, capacity 0.5: cap = 1 per expert and sequence. All four choose expert 0 with gates
    (0.6, 0.9, 0.7, 0.8): by position t0 is kept; by probability t1, the highest. Equal gates fall back
    to position order."""
    choice = np.zeros((1, 4, 1), dtype=int)
    gates = np.array([0.6, 0.9, 0.7, 0.8]).reshape(1, 4, 1)
    assert np.array_equal(admitted(choice, 2, 0.5)[0, :, 0], [True, False, False, False])
    assert np.array_equal(admitted(choice, 2, 0.5, gates)[0, :, 0], [False, True, False, False])
    assert np.array_equal(admitted(choice, 2, 0.5, np.full((1, 4, 1), 0.5))[0, :, 0], [True, False, False, False])
    # k = 2: a token's second choice with a high gate beats another's first choice with a low one
    choice2 = np.array([[[0, 1], [1, 0]]])                   # unnormalised sigmoid gates need not sum to 1
    gates2 = np.array([[[0.3, 0.2], [0.9, 0.8]]])            # expert 0: t0's first (0.3), t1's second (0.8)
    assert np.array_equal(admitted(choice2, 2, 0.5), [[[True, False], [True, False]]])     # cap 1 each
    assert np.array_equal(admitted(choice2, 2, 0.5, gates2), [[[False, False], [True, True]]])


def test_the_layer_drops_by_its_policy():
    """The layer's admissions are admitted(..., gates) under "probs" and differ here from "position"'s."""
    m = layer(4, 2, 0.5, moe_drop_policy="probs")
    randomize(m, seed=4, std=0.5)
    x = np.random.default_rng(7).standard_normal((2, 6, C))
    m.forward(x)
    choice, keep = m.routing
    r = route(x.reshape(12, C) @ m.router.data, 2)
    assert np.array_equal(choice, r.choice.reshape(2, 6, 2))
    by_probs, by_position = admitted(choice, 4, 0.5, r.gate.reshape(2, 6, 2)), admitted(choice, 4, 0.5)
    assert np.array_equal(keep, by_probs) and not np.array_equal(by_probs, by_position)


def test_shared_experts_add_one_wide_mlp_for_every_token():
    """y = the routed experts' gated sum + the shared MLP (width n_shared F) on every token, dropped or not."""
    m = layer(2, 1, 0.5, n_embd=4, moe_shared_experts=2)
    randomize(m, seed=2, std=0.5)
    m.router.data[...] = [[0, math.log(3)], [math.log(3), 0], [0, 0], [0, 0]]
    x = np.array([[[1., 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]])
    y = m.forward(x)
    assert m.shared.fc_weight.data.shape == (4, 2 * 4 * 4)
    shared = ffn(m, None, x[0], m.shared)
    routed = np.stack([0.75 * ffn(m, 1, x[0, 0]), np.zeros(4), np.zeros(4), 0.75 * ffn(m, 0, x[0, 3])])
    assert np.abs(y[0] - (routed + shared)).max() < 1e-14           # cap 1: t1 and t2 dropped (shared only)
    assert m.num_params() == sum(p.data.size for p in m.parameters())


@pytest.mark.parametrize("change,message", [
    ({"moe_router": "switch"}, "moe_router"), ({"moe_topk_norm": "mean"}, "moe_topk_norm"),
    ({"moe_router": "topk-softmax", "moe_topk_norm": "none"}, "normalises the k gates"),
    ({"moe_gate_scale": 0.0}, "moe_gate_scale"), ({"moe_shared_experts": -1}, "moe_shared_experts"),
    ({"moe_drop_policy": "random"}, "moe_drop_policy"), ({"moe_bias_rate": -0.1}, "moe_bias_rate")])
def test_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=C, moe_experts=4, **change).validate()


def test_a_dense_model_refuses_routing_options():
    with pytest.raises(ConfigError, match="--moe-router, --moe-shared-experts set on a dense model"):
        TrainConfig(moe_router="sigmoid", moe_shared_experts=1).validate(1)


def test_the_expert_bias_moves_toward_an_even_load():
    """Loads (5, 1, 3, 3), mean 3: the overloaded expert's bias falls by the rate, the idle one's rises, the
    even ones stay; the counts start again. Counted in the backward, once per micro-batch, every choice."""
    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, n_embd=C, moe_experts=4, moe_top_k=2,
                          moe_bias_rate=0.1), SERIAL, dtype="float64", seed=1)
    (m,) = model.moe_layers()
    m.load[...] = [5, 1, 3, 3]
    balance_experts(model)
    assert np.array_equal(m.expert_bias.data, [-0.1, 0.1, 0.0, 0.0]) and not m.load.any()
    x = np.arange(12).reshape(2, 6) % 11
    model.forward(x, x)
    assert not m.load.any()                                          # a forward alone counts nothing
    model.backward()
    assert m.load.sum() == 2 * 6 * 2 and np.array_equal(m.load, np.bincount(m.routing[0].ravel(), minlength=4))
    reset(model)
    assert not m.load.any()
