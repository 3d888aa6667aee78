"""The mixture-of-experts MLP on one rank (float64): its backward against finite differences, and the
routing, gates, capacity and losses against values worked out by hand.

    python -m pytest -q tests/test_moe_layer.py
"""
import math

import numpy as np
import pytest

from mpi_tp.core.testing import randomize
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.model.moe import MoEMLP
from mpi_tp.model.routing import admitted
from mpi_tp.parallel.topology import Topology

C = 8
SERIAL = Topology.serial()          # one for the whole file: each Topology holds several communicators


def layer(E, k, capacity, aux=0.3, z=0.2, n_embd=C):
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=n_embd, moe_experts=E,
                    moe_top_k=k, moe_capacity=capacity, moe_aux_weight=aux, moe_z_weight=z)
    return MoEMLP("h/0/moe", cfg, SERIAL, "float64", seed=1)


def objective(m, x, R, scale):
    """scale * (sum(y R) + aux_weight aux + z_weight zl): what the layer's backward differentiates."""
    y = m.forward(x)
    return scale * (float((y * R).sum()) + m.loss_term), m.routing


def fd_check(m, x, R, scale, h=1e-5):
    """Analytic gradients of x and every parameter against central differences; the routing
    (choices and admissions) must not change within any step, or the function has a kink there."""
    m.zero_grad()
    m.loss_scale = scale
    _, routing = objective(m, x, R, scale)
    dx = m.backward(scale * R)
    targets = [("x", x, dx)] + [(p.name, p.data, p.grad.copy()) for p in m.parameters()]
    for name, value, grad in targets:
        fd = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            old = value[i]
            value[i] = old + h
            up, r_up = objective(m, x, R, scale)
            value[i] = old - h
            down, r_down = objective(m, x, R, scale)
            value[i] = old
            for r in (r_up, r_down):
                assert all(np.array_equal(a, b) for a, b in zip(r, routing)), f"{name}{i}: routing flips within h"
            fd[i] = (up - down) / (2 * h)
        err = np.abs(grad - fd).max() / max(np.abs(fd).max(), 1e-12)
        assert err < 1e-6, f"{name}: max relative difference {err:.2e} from finite differences"
    return routing


@pytest.mark.parametrize("E,k,capacity", [(4, 1, 0.0), (4, 1, 0.5), (4, 2, 0.0), (3, 2, 0.75)],
                         ids=["top1", "top1-capacity", "top2", "top2-capacity-E3"])
def test_backward_matches_finite_differences(E, k, capacity):
    m = layer(E, k, capacity)
    randomize(m, seed=4, std=0.5)
    rng = np.random.default_rng(E * 10 + k)
    x = rng.standard_normal((2, 6, C))
    R = rng.standard_normal((2, 6, C))
    choice, keep = fd_check(m, x, R, scale=0.5)
    assert len(np.unique(choice)) == E                     # every expert gets tokens
    if capacity:
        assert 0 < (~keep).sum() < keep.size, "the capacity should drop some assignments, not all"
    else:
        assert keep.all()


def ffn(m, e, x, expert=None):
    """Expert e (or the expert given) by hand: gelu(x A_fc + b_fc) A_proj + b_proj (tanh GELU)."""
    ex = m.experts[e] if expert is None else expert
    h = x @ ex.fc_weight.data + ex.fc_bias.data
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return h @ ex.proj_weight.data + ex.proj_bias.data


def test_aux_and_z_loss_and_switch_gate_by_hand():
    """E = 2, k = 1. Router logits (0, ln 3) for tokens 0-2 and (ln 3, 0) for token 3: p = (1/4, 3/4)
    or (3/4, 1/4); choices 1, 1, 1, 0. f = (1/4, 3/4), P = (3/8, 5/8): aux = 2 (3/32 + 15/32) = 9/8;
    lse = ln 4 everywhere: zl = (ln 4)^2; the top-1 gate is the probability 3/4, not 1."""
    m = layer(2, 1, 0.0, n_embd=4)
    randomize(m, seed=2, std=0.5)
    m.router.data[...] = [[0, math.log(3)], [math.log(3), 0], [0, 0], [0, 0]]
    x = np.array([[[1., 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]])      # (1, 4, 4)
    y = m.forward(x)
    assert np.array_equal(m.routing[0][0, :, 0], [1, 1, 1, 0])
    assert abs(m.stats["aux_loss"] - 9 / 8) < 1e-14
    assert abs(m.stats["z_loss"] - math.log(4) ** 2) < 1e-14
    assert abs(m.loss_term - (0.3 * 9 / 8 + 0.2 * math.log(4) ** 2)) < 1e-14
    want = np.stack([0.75 * ffn(m, 1, x[0, t]) for t in range(3)] + [0.75 * ffn(m, 0, x[0, 3])])
    assert np.abs(y[0] - want).max() < 1e-14
    assert list(m.stats["tokens_per_expert"]) == [1, 3] and m.stats["dropped"] == 0


def test_top2_gates_are_renormalised_and_ties_go_low():
    """p = (1/6, 2/6, 3/6): choices (2, 1), gates (3/5, 2/5). Equal logits: choices (0, 1), gates 1/2.
    aux over the k S = 4 assignments: f = (1, 2, 1) / 4, P = (1/4, 1/3, 5/12): aux = 3 (1/16 + 1/6 + 5/48) = 1."""
    m = layer(3, 2, 0.0, n_embd=4)
    randomize(m, seed=2, std=0.5)
    m.router.data[...] = 0
    m.router.data[0] = np.log([1, 2, 3])
    x = np.array([[[1., 0, 0, 0], [0, 1, 0, 0]]])
    y = m.forward(x)
    assert np.array_equal(m.routing[0][0], [[2, 1], [0, 1]])
    assert np.abs(y[0, 0] - (0.6 * ffn(m, 2, x[0, 0]) + 0.4 * ffn(m, 1, x[0, 0]))).max() < 1e-14
    assert np.abs(y[0, 1] - 0.5 * (ffn(m, 0, x[0, 1]) + ffn(m, 1, x[0, 1]))).max() < 1e-14
    assert abs(m.stats["aux_loss"] - 1.0) < 1e-14


def test_capacity_drops_by_choice_rank_then_position():
    """T = 4, E = 2, k = 2, factor 0.5: cap = ceil(0.5 * 4 * 2 / 2) = 2 per expert and sequence.
    First choices 1, 1, 1, 0 (second: the other expert). Admitted in order: first choices t0 (e1),
    t1 (e1), t2 (e1: full, dropped), t3 (e0); then second choices t0 (e0), t1 (e0: full), t2 (e0),
    t3 (e1: full). Position-major order would keep t1's second choice and drop t3's first."""
    choice = np.array([[[1, 0], [1, 0], [1, 0], [0, 1]]])
    want = np.array([[[True, True], [True, False], [False, False], [True, False]]])
    assert np.array_equal(admitted(choice, 2, 0.5), want)
    # Per sequence: two equal sequences drop the same assignments (not the batch's first ones only).
    assert np.array_equal(admitted(np.concatenate([choice, choice]), 2, 0.5), np.concatenate([want, want]))
    assert admitted(choice, 2, 0.0).all()                         # 0: dropless
    assert np.array_equal(admitted(choice, 2, 1.0), np.ones_like(want))          # cap 4: room for all
    # The capacity rounds up (0.6: cap = ceil(2.4) = 3 keeps t1's second choice), after rounding the
    # product's float noise away (1.1 x 25 x 2 / 11 is 5.000000000000001 in floats: cap 5, not 6).
    assert np.array_equal(admitted(choice, 2, 0.6), [[[True, True], [True, True], [True, False], [True, False]]])
    crowd = np.zeros((1, 25, 2), dtype=int)
    crowd[..., 1] = 1                                               # every token: experts 0 then 1
    assert int(admitted(crowd, 11, 1.1).sum()) == 2 * 5

    m = layer(2, 2, 0.5, n_embd=4)
    randomize(m, seed=2, std=0.5)
    m.router.data[...] = [[0, math.log(3)], [math.log(3), 0], [0, 0], [0, 0]]
    x = np.array([[[1., 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0]]])
    y = m.forward(x)
    assert np.array_equal(m.routing[1], want) and m.stats["dropped"] == 4
    assert np.array_equal(y[0, 2], np.zeros(4))                      # both dropped: the residual alone
    assert np.abs(y[0, 1] - 0.75 * ffn(m, 1, x[0, 1])).max() < 1e-14  # its second choice dropped
    assert list(m.stats["tokens_per_expert"]) == [2, 2]


def test_aux_gradient_follows_dout():
    """Two micro-batches of one sequence each, backward with dout = 1/2, give the gradients of the batch
    of both (the aux loss is a mean over sequences, the z-loss over tokens: T is the same)."""
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=C, moe_experts=3, moe_top_k=2,
                    moe_capacity=1.0, moe_aux_weight=0.5, moe_z_weight=0.2)
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    big, small = (GPT(cfg, SERIAL, dtype="float64", seed=2) for _ in range(2))
    for model in (big, small):
        randomize(model, seed=5, std=0.3)
    loss = big.forward(x, y)
    big.backward()
    halves = []
    for i in range(2):
        halves.append(small.forward(x[i:i + 1], y[i:i + 1]))
        small.backward(dout=0.5)
    assert abs(sum(halves) / 2 - loss) < 1e-13
    for p, q in zip(small.parameters(), big.parameters()):
        assert np.abs(p.grad - q.grad).max() <= 1e-12 * max(np.abs(q.grad).max(), 1e-3), p.name


def test_moe_stats_add_up_to_the_loss():
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=3, n_head=2, n_embd=C, moe_experts=4, moe_every=2,
                    moe_aux_weight=0.1, moe_z_weight=0.01)
    model = GPT(cfg, SERIAL, dtype="float64")
    assert [b.moe for b in model.h] == [False, True, False]
    assert any(p.name == "h/1/moe/experts/3/proj/bias" for p in model.parameters())
    assert model.num_params() == sum(p.data.size for p in model.parameters())
    x = np.arange(12).reshape(2, 6) % 11
    loss = model.forward(x, x)
    s = model.moe_stats()
    assert abs(s["cross_entropy"] + 0.1 * s["aux_loss"] + 0.01 * s["z_loss"] - loss) < 1e-14
    assert len(s["layers"]) == 1 and s["layers"][0]["tokens_per_expert"].sum() == 12


@pytest.mark.parametrize("change,message", [
    (dict(moe_top_k=5), "moe_top_k"), (dict(moe_every=4), "moe_every"), (dict(moe_capacity=-1.0), "moe_capacity"),
    (dict(moe_aux_weight=float("nan")), "moe_aux_weight"), (dict(moe_experts=-1), "moe_experts")])
def test_config_errors(change, message):
    cfg = GPTConfig(vocab_size=11, block_size=6, n_layer=3, n_head=2, n_embd=C, moe_experts=4)
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_refused_combinations():
    moe = GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=C, moe_experts=3)
    with pytest.raises(ConfigError, match="ep=4"):
        moe.validate(tp=1, ep=4)
    with pytest.raises(ConfigError, match="needs a mixture-of-experts"):
        GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=C).validate(tp=1, ep=2)


def test_old_configs_load_as_dense():
    saved = dict(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=C, dropout=0.0)   # no moe keys
    cfg = GPTConfig(**saved)
    assert cfg.moe_experts == 0 and not any(b.moe for b in GPT(cfg, SERIAL).h)
