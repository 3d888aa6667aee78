"""Micro-batches (gradient accumulation) through the training loop's own forward_backward: at every
tp x dp layout, with sequence parallelism, ZeRO-1 and dropout, M micro-batches per replica give the
serial model's numbers on the whole global batch in one pass (float64, 4 AdamW steps, < 1e-8); each step
ran M forwards (one pass over all the rows would give the same numbers: the engine's spans are counted)."""
import numpy as np
import pytest
import steps

from mpi_tp.core.params import storages
from mpi_tp.core.testing import assert_close, gather_full
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.parallel.data_parallel import GradReducer
from mpi_tp.parallel.topology import Topology
from mpi_tp.parallel.trace import Trace
from mpi_tp.training.optim import AdamW

pytestmark = pytest.mark.mpi(min_size=1)
CFG = dict(vocab_size=37, block_size=7, n_layer=2, n_head=5, n_embd=20, dropout=0.1)   # uneven at 2, 3, 4
B, STEPS = 2, 4                                                     # sequences per micro-batch and replica


def global_batch(step, rows):
    return steps.global_batch(step, rows, seed=5)


def train(topo, micro, b=B, sp=False, zero=False):
    """Losses and the model after STEPS steps on global batches of dp * micro * b sequences; asserts that
    each step ran `micro` forwards (the schedule's "F" spans, traced)."""
    model = GPT(GPTConfig(**CFG), topo, dtype="float64", seed=3, sequence_parallel=sp)
    reducer = GradReducer(model, topo.dp, bucket_mb=0.001, distributed=bool(zero), stage=max(int(zero), 1))
    opt = AdamW(model.parameters(), lr=1e-2, reducer=reducer)
    topo.stats.trace = Trace()
    losses = steps.train(model, opt, STEPS, micro * b, global_batch, micro, reducer)
    forwards = sum(1 for e in topo.stats.trace.events if (e["name"], e["cat"]) == ("F", "pipeline"))
    topo.stats.trace = None
    assert forwards == STEPS * micro, f"{forwards} micro-batch forwards in {STEPS} steps of {micro}"   # every rank alike
    return losses, model


def layouts(n):
    return [(t, n // t) for t in range(1, n + 1) if n % t == 0]


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("sp,zero", [(False, 0), (True, 1), (False, 2)], ids=["tp", "sp+zero1", "zero2"])
def test_micro_batches_equal_one_big_batch(world, micro, sp, zero):
    for tp, dp in layouts(world.Get_size()):
        ref_losses, ref = train(Topology.serial(), 1, b=dp * micro * B)   # serial: the global batch at once
        topo = Topology.create(world, tp=tp, dp=dp)
        losses, model = train(topo, micro, sp=sp, zero=zero)
        assert_close(losses[:1], ref_losses[:1], 1e-10, f"first loss at tp={tp} dp={dp} M={micro}")
        assert_close(losses, ref_losses, 1e-8, f"losses at tp={tp} dp={dp} M={micro}")
        weights = {p.name: p.data for p in ref.parameters()}
        for p in model.parameters():
            if p.name.endswith("attn/k/bias"):
                continue        # exact gradient 0: its value is rounding noise (docs/tensor_parallelism.md)
            assert_close(gather_full(p, topo.tp.comm), weights[p.name], 1e-8, f"{p.name} at tp={tp} dp={dp}")
        if dp > 1:      # the gradients cross the data-parallel group once per step, not once per micro-batch
            sent = topo.stats.snapshot()["dp/reduce_scatter" if zero else "dp/iall_reduce"]["bytes"]
            assert sent == STEPS * sum(base.nbytes for base, _, _ in storages(model.parameters())), sent
        topo.free()


def test_accumulated_equals_one_pass_serially():
    """One rank: 4 micro-batches of 2 sequences and one batch of 8 give the same step."""
    four, m4 = train(Topology.serial(), 4)
    one, m1 = train(Topology.serial(), 1, b=4 * B)
    assert np.abs(four - one).max() <= 1e-12 * np.abs(one).max(), (four, one)
    for p, q in zip(m4.parameters(), m1.parameters()):
        if p.name.endswith("attn/k/bias"):
            continue                                                # rounding noise around an exact 0
        scale = float(np.abs(q.data).max())
        assert float(np.abs(p.data - q.data).max()) <= 1e-9 * scale, p.name
