"""The online softmax (mpi_tp.core.kernels_online.online_attention_*): attention tile by tile without
the (S, S) probabilities. The kernel equals the dense one (float64, 1e-12) with uneven tiles, grouped-query
shapes and dropout masks of every broadcast shape (its finite differences: tests/test_kernels_attention.py);
the model runs it from ONLINE_FROM positions (lowered to 8 here) and then equals the serial model run densely
at every tensor-parallel size of the pass (1-4: 3 AdamW steps with dropout, sequence parallelism, selective
recomputation; losses and weights < 1e-9), GPT-2 and Llama (grouped-query); its caches hold what
mpi_tp.planning.activations counts.
"""
import numpy as np
import pytest
import steps as steps_helper

from mpi_tp.core import kernels_attention as ka
from mpi_tp.core import kernels_online as ko
from mpi_tp.core.testing import assert_close, gather_full
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology
from mpi_tp.planning import activations
from mpi_tp.training.optim import AdamW

SHAPES = {"mha": ((2, 3, 23, 4), (2, 3, 23, 4)), "gqa": ((2, 2, 3, 23, 4), (2, 2, 1, 23, 4))}
ARCHS = {"gpt2": dict(), "llama": dict(arch="llama", n_kv_head=2, intermediate_size=22)}


@pytest.mark.parametrize("heads", list(SHAPES))
@pytest.mark.parametrize("mask", [None, "full", "2d"])
@pytest.mark.parametrize("block", [1, 5, 8, 23, 64])
def test_online_equals_dense(heads, mask, block):
    rng = np.random.default_rng(block)
    qs, ks = SHAPES[heads]
    q, k, v, dout = rng.standard_normal(qs), rng.standard_normal(ks), rng.standard_normal(ks), rng.standard_normal(qs)
    m = None if mask is None else rng.random(qs[:-1] + (qs[-2],) if mask == "full" else (23, 23)) > 0.3
    dense, dc = ka.attention_forward(q, k, v, m, 1.4)
    tiles = []                                         # each tile's mask is asked for by its slices
    online, oc = ko.online_attention_forward(q, k, v, None if m is None else
                                             lambda r, c: tiles.append(1) or m[..., r, c], 1.4, block=block)
    assert np.abs(online - dense).max() < 1e-12
    assert not any(a is not None and getattr(a, "shape", ())[-2:] == (23, 23) and a.dtype != bool for a in oc)
    for a, b in zip(ko.online_attention_backward(dout, oc), ka.attention_backward(dout, dc)):
        assert a.shape == b.shape and np.abs(a - b).max() < 1e-12


def cfg(arch):
    return GPTConfig(vocab_size=37, block_size=12, n_layer=2, n_head=4, n_embd=16, dropout=0.1, **ARCHS[arch])


def train(config, topo, sp=False, recompute="none", steps=3):
    model = GPT(config, topo, dtype="float64", seed=5, sequence_parallel=sp, recompute=recompute)
    opt = AdamW(model.parameters(), lr=1e-2)

    def batch(step, rows):                             # 12 positions and their next ones: one draw of 13
        x = np.random.default_rng([3, step]).integers(0, 37, (rows, 13))
        return x[:, :-1], x[:, 1:]
    return steps_helper.train(model, opt, steps, 2, batch), model


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_model_online_equals_the_serial_model_dense(world, arch, monkeypatch):
    ref_losses, ref = train(cfg(arch), Topology.serial())                # S 12 < ONLINE_FROM: dense
    ref = {p.name: p.data for p in ref.parameters()}
    monkeypatch.setattr(ka, "ONLINE_FROM", 8)
    calls = []
    backward = ko.online_attention_backward
    monkeypatch.setattr(ko, "online_attention_backward", lambda *a: calls.append(1) or backward(*a))
    T = world.Get_size()
    for sp, recompute in ([(False, "none"), (True, "selective")] if T > 1 else [(False, "none"), (False, "selective")]):
        topo = Topology.create(world, tp=T)
        losses, model = train(cfg(arch), topo, sp, recompute)
        what = f"{arch} tp={T} sp={sp} recompute={recompute}"
        assert len(calls) == 3 * 2 and not calls.clear()                 # 3 steps x 2 blocks, online
        assert_close(losses, ref_losses, 1e-9, f"losses, {what}")
        for p in model.parameters():
            if not p.name.endswith("attn/k/bias"):      # exact gradient 0: rounding noise (docs/tensor_parallelism.md)
                assert_close(gather_full(p, topo.tp.comm), ref[p.name], 1e-9, f"{p.name}, {what}")
        topo.free()


@pytest.mark.parametrize("dropout, recompute", [(0.0, "none"), (0.1, "none"), (0.1, "selective")])
def test_the_online_caches_hold_what_the_formula_counts(monkeypatch, dropout, recompute):
    """From ONLINE_FROM positions a block keeps the attention output and log-sum-exp, not the softmax output
    (its dropout mask still, also under selective recomputation): measured = activation_terms, term by term."""
    monkeypatch.setattr(ka, "ONLINE_FROM", 16)
    monkeypatch.setattr(activations, "ONLINE_FROM", 16)
    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=32, dropout=dropout), dtype="float64",
                seed=0, recompute=recompute)
    x = np.random.default_rng(0).integers(0, 256, (2, 33))
    model.forward(x[:, :-1], x[:, 1:])
    want = activations.activation_terms(32, 2, 32, 4, dropout=dropout > 0, recompute=recompute, value_bytes=8)
    assert "softmax output" not in want and "attention log-sum-exp" in want
    assert activations.measured_terms(model.h[0]) == want


def test_the_online_softmax_draws_its_dropout_masks_by_tile(monkeypatch):
    """With dropout the online path never draws (B, H, S, S): each strip of query rows is drawn once over the
    keys it sees (Masks.tile), forward and backward the same bits: over 8 strips the loss and gradients equal
    the dense path's with its whole mask (float64); and the pass's peak memory gains less than a quarter of one
    whole mask's bytes, which the kernel used to hold."""
    import tracemalloc

    from mpi_tp.model.dropout import Masks
    B, S, H = 1, 1024, 2
    x = np.random.default_rng(0).integers(0, 256, (B, S + 1))

    def run(dtype="float64"):
        model = GPT(GPTConfig(n_layer=1, n_head=H, n_embd=16, block_size=S, dropout=0.1), dtype=dtype, seed=0)
        loss = model.forward(x[:, :-1], x[:, 1:])
        model.backward()
        return loss, {p.name: p.grad.copy() for p in model.parameters()}
    dense_loss, dense_grads = run()                      # S < ONLINE_FROM: the blocked form, the whole mask
    monkeypatch.setattr(ka, "ONLINE_FROM", 64)
    drawn = []
    tile = Masks.tile
    monkeypatch.setattr(Masks, "tile", lambda self, *a: drawn.append(a[-1] * a[-3]) or tile(self, *a))
    monkeypatch.setattr(Masks, "head_masks", lambda *a: pytest.fail("a whole (S, S) mask drawn"))
    loss, grads = run()
    assert abs(loss - dense_loss) < 1e-12 * abs(dense_loss)
    for name, g in grads.items():
        if not name.endswith("attn/k/bias"):            # exact gradient 0: rounding noise (as above)
            assert_close(g, dense_grads[name], 1e-9, name)
    strips = S // ka.QUERY_BLOCK
    assert len(drawn) == 2 * strips and max(drawn) <= ka.QUERY_BLOCK * S     # forward + backward, a strip each

    def peak(dropout):                                 # bytes allocated at most during one forward + backward
        model = GPT(GPTConfig(n_layer=1, n_head=H, n_embd=16, block_size=S, dropout=dropout), dtype="float32", seed=0)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        model.forward(x[:, :-1], x[:, 1:])
        model.backward()
        out = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        return out
    more = peak(0.1) - peak(0.0)
    assert more < B * H * S * S / 4, f"dropout adds {more} bytes to the peak: a whole mask is {B * H * S * S}"
