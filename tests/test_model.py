"""The whole GPT at tp = world size equals the serial model: loss, gradients, training, communication."""
import numpy as np
import pytest
import steps as tests_steps

from mpi_tp.core.testing import all_true, assert_close, gather_full, randomize
from mpi_tp.model.config import ConfigError, GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.training.optim import SGD, AdamW, clip_grad_norm

pytestmark = pytest.mark.mpi(min_size=1)
# Uneven splits (shares per rank; tests/run.sh runs 1, 2, 3 and 4 ranks):
#   tp = 2: heads 3 + 2,          vocabulary 19 + 18,          MLP width 4C = 80: 40 + 40
#   tp = 3: heads 2 + 2 + 1,      vocabulary 13 + 12 + 12,     MLP width 27 + 27 + 26
#   tp = 4: heads 2 + 1 + 1 + 1,  vocabulary 10 + 9 + 9 + 9,   MLP width 20 each
# 4C is a multiple of 4, so the MLP splits unevenly only where tp does not divide it: the 3-rank pass.
CFG = dict(vocab_size=37, block_size=8, n_layer=2, n_head=5, n_embd=20)


def batch(seed, B=3, T=8, V=37):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))


def pair(world, **over):
    cfg = dict(CFG, **over)
    ser = GPT(GPTConfig(**cfg), Topology.serial(), dtype="float64", seed=11)
    par = GPT(GPTConfig(**cfg), Topology.create(world), dtype="float64", seed=11)
    return ser, par


def grad_scale(model):
    return max(float(np.abs(p.grad).max()) for p in model.parameters())


def test_same_initial_weights(world):
    ser, par = pair(world)
    serial = {p.name: p for p in ser.parameters()}
    for p in par.parameters():
        assert_close(gather_full(p, world), serial[p.name].data, 0, p.name)   # bitwise


def test_loss_and_gradients(world):
    ser, par = pair(world)
    randomize(ser, std=0.1), randomize(par, std=0.1)
    x, y = batch(0)
    l_ref, l = ser.forward(x, y), par.forward(x, y)
    assert_close(np.array(l), np.array(l_ref), 1e-10, "loss")
    ser.backward(), par.backward()
    scale = grad_scale(ser)
    serial = {p.name: p for p in ser.parameters()}
    for p in par.parameters():
        q = serial[p.name]
        assert_close(p.grad, q.grad[p.index()], 1e-10, f"{p.name}.grad (local)", scale)
        assert_close(gather_full(p, world, "grad"), q.grad, 1e-10, f"{p.name}.grad (gathered)", scale)


def train(model, steps, opt_cls, clip=1.0, **opt):
    """The library's steps (mpi_tp.training.step) on two batches, revisited: the loss must fall."""
    return tests_steps.train(model, opt_cls(model.parameters(), **opt), steps, 3, lambda k, rows: batch(100 + k % 2),
                             grad_clip=clip)


@pytest.mark.parametrize("opt_cls,opt", [(AdamW, dict(lr=3e-3, weight_decay=0.1)),
                                         (SGD, dict(lr=0.3, momentum=0.9, weight_decay=0.01))])
def test_training_curve(world, opt_cls, opt):
    ser, par = pair(world)
    ref = train(ser, 20, opt_cls, **opt)
    got = train(par, 20, opt_cls, **opt)
    assert ref[-1] < ref[0] - 0.1, "the serial model did not learn: the test would prove nothing"
    assert_close(got, ref, 1e-8, "loss curve")
    serial = {p.name: p for p in ser.parameters()}
    for p in par.parameters():
        if p.name.endswith("attn/k/bias"):
            # q.b_k is the same for every key of a query, so softmax cancels it: its exact gradient
            # is 0 and the computed one is rounding noise (~1e-17), which Adam's g/sqrt(v) blows up
            # to lr-sized steps. Its value is noise at every layout and does not move the loss.
            continue
        assert_close(gather_full(p, world), serial[p.name].data, 1e-8, f"{p.name} after 20 steps")


def test_dropout_matches_serial(world):
    """Dropout masks are keyed by (seed, step, layer, site[, global head]): the same at every tp size."""
    ser, par = pair(world, dropout=0.2)
    plain = GPT(GPTConfig(**CFG), Topology.serial(), dtype="float64", seed=11)   # no dropout
    ref = train(ser, 3, AdamW, lr=1e-3)
    got = train(par, 3, AdamW, lr=1e-3)
    assert_close(got, ref, 1e-10, "loss curve with dropout")
    assert abs(train(plain, 1, AdamW, lr=1e-3)[0] - ref[0]) > 1e-3, "dropout changed no loss: it never ran"
    for p, q in zip(plain.parameters(), ser.parameters()):
        p.data[...] = q.data
    x, y = batch(7)
    assert ser.forward(x, y) != plain.forward(x, y), "training: dropout must change the loss"
    ser.eval(), par.eval()
    # eval mode: no mask at all, so exactly the model without dropout, at every layout
    assert ser.forward(x, y) == plain.forward(x, y) == ser.forward(x, y)
    assert_close(np.array(par.forward(x, y)), np.array(plain.forward(x, y)), 1e-12, "eval loss, tp")


def test_replicated_params_stay_identical(world):
    _, par = pair(world)
    train(par, 3, AdamW, lr=1e-2)
    for p in par.parameters():
        if not p.sharded:
            mine = p.data.copy()
            world.Bcast(mine, root=0)
            assert all_true(np.array_equal(mine, p.data), world), f"{p.name} differs between ranks"


def test_communication_matches_megatron(world):
    """Per step: 2 all-reduces of B*T*C per block forward and 2 backward, plus embedding, head and loss."""
    _, par = pair(world)
    B, T, C, L = 3, 8, CFG["n_embd"], CFG["n_layer"]
    stats = par.topo.stats
    act = B * T * C * 8                                    # one float64 activation
    x, y = batch(0)
    stats.reset()
    par.forward(x, y)
    fwd = stats.snapshot()
    stats.reset()
    par.backward()
    bwd = stats.snapshot()
    stats.reset()
    clip_grad_norm(par.parameters(), par.topo.tp, 1.0)
    clip = stats.snapshot()
    if world.Get_size() == 1:
        assert fwd == bwd == clip == {}
        return
    # forward: embedding g + 2 per block (attention g, MLP g) + loss: MAX of B*T and SUM of 2*B*T values
    assert fwd["tp/all_reduce"]["calls"] == 1 + 2 * L + 2
    assert fwd["tp/all_reduce"]["bytes"] == (1 + 2 * L) * act + 3 * B * T * 8
    # backward: 2 per block (attention f, MLP f) + the tied head's f; the embedding's g needs none
    assert bwd["tp/all_reduce"]["calls"] == 2 * L + 1
    assert bwd["tp/all_reduce"]["bytes"] == (2 * L + 1) * act
    assert clip["tp/all_reduce"]["calls"] == 1 and clip["tp/all_reduce"]["bytes"] == 8
    assert set(fwd) == set(bwd) == {"tp/all_reduce"}      # nothing else moves


def test_bad_configs(world):
    with pytest.raises(ConfigError, match="must divide"):
        GPT(GPTConfig(n_embd=20, n_head=6), Topology.serial())
    with pytest.raises(ConfigError, match="exceeds n_head"):
        GPTConfig(n_head=2, n_embd=8).validate(tp=3)
    with pytest.raises(ConfigError, match="positive"):
        GPTConfig(n_layer=0).validate()
    with pytest.raises(ConfigError, match="vocab_size"):
        GPTConfig(vocab_size=2, n_head=4, n_embd=8).validate(tp=4)


def test_backward_without_forward(world):
    _, par = pair(world)
    with pytest.raises(RuntimeError, match="without"):
        par.backward()


class NoPickle:
    """A communicator that refuses mpi4py's lowercase (pickling) methods and passes the rest on."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name[0].islower() and name not in ("py2f",):
            raise AssertionError(f"pickled MPI call {name}() on a per-step path")
        return getattr(self._comm, name)


def test_no_pickled_calls_in_a_training_step(world):
    _, par = pair(world, dropout=0.1)
    par.topo.tp.comm = NoPickle(par.topo.tp.comm)
    train(par, 2, AdamW, lr=1e-3)          # forward, backward, clipping, update: buffer methods only
    par.topo.tp.comm = par.topo.tp.comm._comm
