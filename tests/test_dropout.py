"""Dropout masks drawn by counter (mpi_tp.model.dropout): bool, kept with probability 1 - p, and
the same bits for the same global element whichever slice a rank draws.

    .venv/bin/python -m pytest -q tests/test_dropout.py
    mpiexec -n 3 python -m mpi4py -m pytest -q --with-mpi -m mpi tests/test_dropout.py

The layout tests cut the heads (5: 3+2 / 2+2+1 / 2+1+1+1), the positions (7: 4+3 / 3+2+2 /
2+2+2+1) and the rows of a batch the way T = 2, 3, 4, replicas and micro-batches do, draw each
part alone and compare it with the slice of the serial draw; the MPI test does the same with the
model's own SequenceSplit and ParallelAttention on the world's tensor-parallel group.
"""
import numpy as np
import pytest

from mpi_tp.core import backend
from mpi_tp.core.testing import all_true
from mpi_tp.model.attention import ParallelAttention
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.dropout import Dropout, Masks, region_mask
from mpi_tp.parallel.sequence_parallel import SequenceSplit
from mpi_tp.parallel.topology import Topology, offsets, split_sizes

B, H, S, C = 6, 5, 7, 3


class Split:
    """A SequenceSplit's positions for rank i of T, without a communicator."""

    def __init__(self, T, i):
        start = offsets(split_sizes(S, T))[i]
        self.positions = slice(start, start + split_sizes(S, T)[i])


def dropout(p=0.25, seed=11, step=3, row0=0):
    """A pass's masks (model.dropout.Masks), as a Dropout of p and seed gives them at `step` for row0."""
    d = Dropout(p, seed)
    d.step = step
    return d.masks(row0) if p > 0 else Masks(p, seed, step, row0)


def test_masks_are_bool_with_the_shapes_asked():
    d = dropout()
    assert d.head_masks(B, S, range(1, 4), layer=0).shape == (B, 3, S, S)
    assert d.head_masks(B, S, range(1, 4), layer=0).dtype == np.bool_
    y = np.zeros((B, S, C), dtype=np.float32)
    assert region_mask(d, y, None, 2, 3).shape == (B, S, C)
    assert region_mask(d, y, None, 2, 3).dtype == np.bool_


@pytest.mark.parametrize("T", [2, 3, 4])
def test_heads_and_positions_drawn_apart_equal_the_whole(T):
    d = dropout()
    whole = d.head_masks(B, S, range(H), layer=1)                            # (B, H, S, S)
    y = np.zeros((B, S, C))
    region = region_mask(d, y, None, 1, 2)                                    # (B, S, C)
    for i in range(T):
        start, H_i = offsets(split_sizes(H, T))[i], split_sizes(H, T)[i]
        np.testing.assert_array_equal(d.head_masks(B, S, range(start, start + H_i), layer=1),
                                      whole[:, start:start + H_i], err_msg=f"heads of rank {i} of {T}")
        sp = Split(T, i)
        mine = region_mask(d, y[:, sp.positions], sp, 1, 2)                  # (B, S_i, C)
        np.testing.assert_array_equal(mine, region[:, sp.positions], err_msg=f"positions of rank {i} of {T}")


@pytest.mark.parametrize("parts", [[6], [3, 3], [4, 2], [1, 2, 3], [1] * 6])
def test_rows_drawn_apart_equal_the_whole(parts):
    """Replicas and micro-batches draw their rows of the global batch (row0, their B) alone."""
    whole = dropout().head_masks(B, S, range(H), layer=0)
    region = region_mask(dropout(), np.zeros((B, S, C)), None, 0, 3)
    for row0, B_part in zip(offsets(parts), parts):
        d = dropout(row0=row0)
        np.testing.assert_array_equal(d.head_masks(B_part, S, range(H), layer=0), whole[row0:row0 + B_part])
        np.testing.assert_array_equal(region_mask(d, np.zeros((B_part, S, C)), None, 0, 3),
                                      region[row0:row0 + B_part])


def test_every_part_of_the_name_changes_the_mask():
    """seed, step, layer, site, head and row each select another stream (the embedding is layer -1)."""
    def draw(seed=11, step=3, layer=0, site=2, row0=0):
        return region_mask(dropout(seed=seed, step=step, row0=row0), np.zeros((1, 64, 64)), None, layer, site)
    base = draw()
    for other in (draw(seed=12), draw(step=4), draw(layer=1), draw(layer=-1), draw(site=3), draw(row0=1)):
        assert (other != base).mean() > 0.3                   # 2 p (1 - p) = 0.375 for independent masks
    heads = dropout().head_masks(1, 64, range(2), layer=0)
    assert (heads[0, 0] != heads[0, 1]).mean() > 0.3


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_is_one_minus_p(p):
    d = dropout(p=p)
    keep = d.keep(4, layer=0, site=3, start=0, stop=1 << 18)                # 2^20 elements
    n, want = keep.size, 1.0 - d.threshold / 2**16
    assert abs(want - (1.0 - p)) <= 2**-17                                   # p rounded to 16 bits
    sigma = (want * (1 - want) / n) ** 0.5
    assert abs(keep.mean() - want) < 5 * sigma, (keep.mean(), want, sigma)
    assert d.scale == 1.0 / want                                             # E[mask * scale] = 1


def test_threshold_and_scale_at_the_edges():
    assert dropout(p=0.0).threshold == 0 and dropout(p=0.0).scale == 1.0
    assert dropout(p=0.1).threshold == 6554
    assert dropout(p=1 - 1e-9).threshold == 2**16 - 1                       # p < 1 always keeps some


def test_apply_scales_where_the_mask_is_applied():
    d = dropout(p=0.1)
    x = np.arange(1, 13, dtype=np.float32).reshape(2, 2, 3)
    mask = region_mask(d, x, None, 0, 2)
    out = d.apply(x, mask)
    assert out.dtype == np.float32 and not np.shares_memory(out, x)
    np.testing.assert_array_equal(out, np.where(mask, x * np.float32(d.scale), 0))


class NotNumpy:
    """NumPy under another name: Dropout then takes the device path (philox.generic_words)."""

    def __getattr__(self, name):
        return getattr(np, name)


def test_the_device_path_draws_the_same_masks(monkeypatch):
    d = dropout()
    heads = d.head_masks(2, S, range(1, 4), layer=2)
    region = region_mask(d, np.zeros((2, 4, C)), Split(2, 0), 2, 3)
    monkeypatch.setattr(backend, "_xp", NotNumpy())
    np.testing.assert_array_equal(d.head_masks(2, S, range(1, 4), layer=2), heads)
    np.testing.assert_array_equal(region_mask(d, np.zeros((2, 4, C)), Split(2, 0), 2, 3), region)


@pytest.mark.mpi(min_size=1)
def test_each_rank_draws_its_slice_of_the_serial_masks(world):
    """The model's own split: ParallelAttention's heads and SequenceSplit's positions on the world's
    tensor-parallel group (uneven at 2, 3 and 4 ranks), against the serial draw."""
    topo = Topology.create(world, tp=world.Get_size())
    if H < topo.tp.size or S < topo.tp.size:
        pytest.skip("more ranks than heads or positions")
    cfg = GPTConfig(vocab_size=11, block_size=S, n_layer=2, n_head=H, n_embd=2 * H)
    d = dropout()
    attn = ParallelAttention("attn", cfg, topo, np.float64, 0, layer=1)
    sp = SequenceSplit(topo.tp, S)
    y = np.zeros((B, sp.sizes[topo.tp.rank], C))
    heads = d.head_masks(B, S, attn.heads, 1)
    region = region_mask(d, y, sp, 1, 3)
    same = (np.array_equal(heads, d.head_masks(B, S, range(H), 1)[:, attn.heads.start:attn.heads.stop])
            and np.array_equal(region, region_mask(d, np.zeros((B, S, C)), None, 1, 3)[:, sp.positions]))
    assert all_true(same, world)
