"""Causal attention in blocks of query rows (mpi_tp.core.kernels_attention): the blocked path equals the dense
one (float64, 1e-12: the same arithmetic on fewer keys) with an uneven last block, grouped-query shapes and
dropout masks of every broadcast shape, keeps the same cache (probabilities zero above the diagonal), and its
gradients match finite differences."""
import numpy as np
import pytest

from mpi_tp.core import kernels_attention as ka
from mpi_tp.core import kernels_online as ko

SHAPES = {"mha": ((2, 3, 23, 4), (2, 3, 23, 4)), "gqa": ((2, 2, 3, 23, 4), (2, 2, 1, 23, 4))}


@pytest.mark.parametrize("heads", list(SHAPES))
@pytest.mark.parametrize("mask", [None, "full", "2d"])
@pytest.mark.parametrize("block", [1, 5, 8, 22])
def test_blocked_equals_dense(heads, mask, block):
    rng = np.random.default_rng(block)
    qs, ks = SHAPES[heads]
    q, k, v, dout = rng.standard_normal(qs), rng.standard_normal(ks), rng.standard_normal(ks), rng.standard_normal(qs)
    m = None if mask is None else rng.random(qs[:-1] + (qs[-2],) if mask == "full" else (23, 23)) > 0.3
    dense, dc = ka.attention_forward(q, k, v, m, 1.4, block=64)
    blocked, bc = ka.attention_forward(q, k, v, m, 1.4, block=block)
    assert np.abs(blocked - dense).max() < 1e-12
    assert np.abs(bc[3] - dc[3]).max() < 1e-12 and not np.triu(bc[3], 1).any()   # the same cache
    for a, b in zip(ka.attention_backward(dout, bc), ka.attention_backward(dout, dc)):
        assert a.shape == b.shape and np.abs(a - b).max() < 1e-12


FORMS = {"blocked": (ka.attention_forward, ka.attention_backward),
         "online": (ko.online_attention_forward, ko.online_attention_backward)}


@pytest.mark.parametrize("form", list(FORMS))
def test_gradients_match_finite_differences(form):
    """The blocked form and the online softmax (tests/test_online_attention.py), blocks of 4 over 9 positions."""
    forward, backward = FORMS[form]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 3)) for _ in range(3))
    dout = rng.standard_normal((1, 2, 9, 3))

    def loss(q, k, v):
        return float((forward(q, k, v, block=4)[0] * dout).sum())
    grads = backward(dout, forward(q, k, v, block=4)[1])
    for name, x, g in zip("qkv", (q, k, v), grads):
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            x[i] += 1e-6
            up = loss(q, k, v)
            x[i] -= 2e-6
            down = loss(q, k, v)
            x[i] += 1e-6
            num[i] = (up - down) / 2e-6
        assert np.abs(num - g).max() < 1e-7, name


@pytest.mark.parametrize("heads", list(SHAPES))
@pytest.mark.parametrize("mask", [None, "full", "2d"])
@pytest.mark.parametrize("block", [5, 64])
def test_backward_by_batch_rows_is_the_same_bits(monkeypatch, heads, mask, block):
    """The backward a batch row at a time (CHUNK_BYTES of one row: each row its own chunk) gives the bits of the
    whole batch at once (the default, these arrays being small), dense and blocked, with every mask
    shape (a 2-d mask broadcasts over the batch rows: every chunk takes it whole)."""
    rng = np.random.default_rng(7)
    qs, ks = SHAPES[heads]
    q, k, v, dout = rng.standard_normal(qs), rng.standard_normal(ks), rng.standard_normal(ks), rng.standard_normal(qs)
    m = None if mask is None else rng.random(qs[:-1] + (qs[-2],) if mask == "full" else (23, 23)) > 0.3
    cache = ka.attention_forward(q, k, v, m, 1.4, block=block)[1]
    assert len(ka._batch_rows(cache[3], q, k, v, dout)) == 1          # 2 x 3 x 23 x 23 doubles: one chunk
    whole = ka.attention_backward(dout, cache)
    monkeypatch.setattr(ka, "CHUNK_BYTES", cache[3].nbytes // 2)              # one batch row per chunk
    assert len(ka._batch_rows(cache[3], q, k, v, dout)) == 2
    monkeypatch.setattr(ka, "CHUNK_BYTES", cache[3].nbytes // 2 - 1)          # a row past the budget: whole
    assert len(ka._batch_rows(cache[3], q, k, v, dout)) == 1
    monkeypatch.setattr(ka, "CHUNK_BYTES", cache[3].nbytes // 2)
    for a, b in zip(ka.attention_backward(dout, cache), whole):
        assert a.shape == b.shape and np.array_equal(a, b)
