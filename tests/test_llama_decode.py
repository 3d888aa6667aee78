"""Cached decoding of the Llama model against its full forward pass, grouped-query attention included.

float64, 4 query heads with 4, 2 or 1 key/value heads: at 2, 3 and 4 ranks the key/value heads are
split (H_kv >= T) or replicated (H_kv < T, mpi_tp.model.heads). Rows of different lengths decode side by side
(each row's rotations at its own positions), join and leave, and slide past block_size.
"""
import numpy
import pytest
from decoding import join_step_leave

from mpi_tp.core.testing import all_true
from mpi_tp.inference.decode import Decoder
from mpi_tp.inference.generate import Request, generate
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.topology import Topology

pytestmark = pytest.mark.mpi(min_size=1)
S = 10


def cfg(H_kv):
    return GPTConfig(vocab_size=37, block_size=S, n_layer=2, n_head=4, n_embd=16, arch="llama", n_kv_head=H_kv,
                     intermediate_size=22)


def models(world, H_kv, seed=3):
    serial = GPT(cfg(H_kv), Topology.serial(), dtype="float64", seed=seed).eval()
    topo = Topology.create(world, tp=world.Get_size())
    return serial, GPT(cfg(H_kv), topo, dtype="float64", seed=seed).eval(), topo


@pytest.mark.parametrize("H_kv", [4, 2, 1])
def test_cached_logits_equal_the_full_context_at_every_position(world, H_kv):
    serial, model, topo = models(world, H_kv)
    plan = {0: [[1, 2, 3, 4, 5], [6]], 3: [[7, 8]], 8: [list(range(10))]}    # rows of their own lengths
    leaving = {6: [0], 12: [1]}
    _, rows, worst = join_step_leave(model, serial, plan, leaving, 2 * S + 2, numpy.random.default_rng(H_kv))
    assert max(len(r) for r in rows) > S                 # some row slid past block_size
    assert all_true(worst < 1e-10, world), worst
    topo.free()


def test_the_cache_holds_the_key_value_heads_only(world):
    """The cache's bytes: H_kv/H of the multi-head model's, on every rank whose kv heads are its own; with
    H_kv < T each rank keeps the one key/value head its query heads read."""
    T = world.Get_size()
    nbytes = {}
    for H_kv in (4, 2, 1):
        _, model, topo = models(world, H_kv)
        dec = Decoder(model, 2)
        attn = model.h[0].attn
        assert dec.cache.k[0].shape == (2, attn.H_kv_i, S, 4)
        nbytes[H_kv] = dec.cache.nbytes
        topo.free()
    if T == 1:
        assert nbytes[2] * 2 == nbytes[4] and nbytes[1] * 4 == nbytes[4]
    total = {H_kv: world.allreduce(n) for H_kv, n in nbytes.items()}
    if T <= 2:                                           # H_kv >= T for H_kv = 2: split, every head once
        assert total[2] * 2 == total[4]
    assert nbytes[1] == 2 * 2 * 2 * 1 * S * 4 * 8        # keys and values x blocks x slots x 1 head x S x hs x 8


@pytest.mark.parametrize("H_kv", [2, 1])
def test_generated_text_is_the_serial_models(world, H_kv):
    serial, model, topo = models(world, H_kv, seed=5)
    reqs = [Request(bytes([1, 2, 3]), max_tokens=14, temperature=0),
            Request(bytes([2, 9]), max_tokens=12, temperature=0.9, top_p=0.9, seed=11)]
    assert all_true(generate(model, reqs) == generate(serial, reqs), world)
    topo.free()
