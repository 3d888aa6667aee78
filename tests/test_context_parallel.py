"""Context parallelism: ring attention against the serial attention kernel, and its messages counted.

At every world size of the pass the world is one cp group; q, k and v of the whole sequence are the
same on every rank and each rank takes its two chunks (S = 13: uneven chunks at every size). The ring's
output and its gradients equal kernels.attention_forward / attention_backward's at this rank's
positions (float64, 1e-12), with grouped-query shapes and with a dropout mask, and the sends and
receives on the group "cp" equal the closed form of mpi_tp.parallel.ring_attention's docstring.
"""
import numpy as np
import pytest

from mpi_tp.core import kernels as kern
from mpi_tp.core.testing import assert_close
from mpi_tp.parallel.context_parallel import ContextSplit
from mpi_tp.parallel.ring_attention import ring_backward, ring_forward
from mpi_tp.parallel.topology import Topology

S = 13


def whole(shape, seed, dtype="float64"):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def ring_case(world, grouped, dropout, dtype="float64"):
    """One cp group over the world; the whole sequence's q, k, v, dout (grouped-query shapes when grouped)
    in dtype, a dropout mask (about 70% kept) or None, and the take of this rank's rows:
    (topo, split, (q, k, v, dout), mask, mine)."""
    topo = Topology.create(world, tp=1, cp=world.Get_size())
    split = ContextSplit(topo.cp, S)
    B, hs = 2, 4
    qshape, kshape = ((B, 2, 3, S, hs), (B, 2, 1, S, hs)) if grouped else ((B, 3, S, hs), (B, 3, S, hs))
    tensors = whole(qshape, 1, dtype), whole(kshape, 2, dtype), whole(kshape, 3, dtype), whole(qshape, 4, dtype)
    mask = whole(qshape[:-1] + (S,), 5) > -0.5 if dropout else None
    return topo, split, tensors, mask, lambda a: split.take(a, axis=a.ndim - 2)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("grouped, dropout", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["mha", "gqa", "mha-dropout", "gqa-dropout"])
def test_ring_attention_equals_the_serial_kernel(world, grouped, dropout):
    n = world.Get_size()
    topo, split, (q, k, v, dout), mask, mine = ring_case(world, grouped, dropout)
    ref, cache = kern.attention_forward(q, k, v, mask, 1.4)
    dq, dk, dv = kern.attention_backward(dout, cache)
    pos = split.positions

    def mask_of(src, rows, cols):
        keys = split.positions_of(src)
        return mask[..., pos[rows], :][..., keys[cols]]
    before = dict(topo.stats.calls)
    out, c = ring_forward(mine(q), mine(k), mine(v), split, mask_of if dropout else None, 1.4)
    sent_forward = topo.stats.calls["cp/send"] - before.get("cp/send", 0)
    got = ring_backward(mine(dout), c)
    assert_close(out, mine(ref), 1e-12, "ring attention's output", comm=world)
    for name, a, b in zip(("dq", "dk", "dv"), got, (dq, dk, dv)):
        assert_close(a, mine(b), 1e-12, f"ring attention's {name}", comm=world)
    sent = topo.stats.calls["cp/send"] - before.get("cp/send", 0)
    received = topo.stats.calls["cp/recv"] - before.get("cp/recv", 0)
    assert (sent_forward, sent, received) == ((n - 1, 3 * n - 2, 3 * n - 2) if n > 1 else (0, 0, 0))


@pytest.mark.mpi(min_size=1)
def test_the_chunks_hold_every_position_once_and_balance_the_work(world):
    """Every position on one rank; at each ring step after the first every rank computes the same number
    of scores (S a multiple of 2Z: chunks alike), where a plain split into Z runs would leave rank 0 idle."""
    from mpi_tp.parallel.ring_attention import blocks
    n = world.Get_size()
    topo = Topology.create(world, tp=1, cp=n)
    split = ContextSplit(topo.cp, S)
    every = np.concatenate(world.allgather(split.positions))
    assert sorted(every) == list(range(S))
    split = ContextSplit(topo.cp, 6 * n)
    work = [sum((r.stop - r.start) * (c.stop - c.start) for r, c, _ in blocks(split, (world.Get_rank() - s) % n))
            for s in range(n)]
    steps = world.allgather(work)
    assert all(len({w[s] for w in steps}) == 1 for s in range(n)), steps
    assert steps[0][1:] == [18] * (n - 1)                   # half a block of 6 x 6: (2 x 3) x 3 or 3 x (2 x 3)
    with pytest.raises(Exception, match="cannot be cut into"):
        ContextSplit(topo.cp, 2 * n - 1)
