"""What the training tests share: global batches, and steps through the library's own step
(mpi_tp.training.step.train_step), so that no test writes its own version of a training step."""
import numpy as np

from mpi_tp.core.testing import assert_close
from mpi_tp.training.step import train_step


def global_batch(step, rows, S=7, V=37, seed=9):
    """The global batch of `step`: (x, y), `rows` sequences of S tokens below V, the same on every rank."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, V, (rows, S)), rng.integers(0, V, (rows, S))


def train(model, opt, steps, per_replica, batch=global_batch, micro_batches=None, reducer=None, grad_clip=1.0):
    """The losses of `steps` library steps of `model` (a GPT or a pipeline stage) and `opt`: step k on the
    global batch batch(k, dp x per_replica), of which this replica takes its rows (Topology.replica_rows)."""
    rows = model.topo.replica_rows(per_replica)
    losses = []
    for step in range(steps):
        x, y = batch(step, per_replica * model.topo.dp.size)
        loss, _, problem = train_step(model, opt, x, y, rows, micro_batches, grad_clip=grad_clip, reducer=reducer)
        assert problem is None, f"step {step}: {problem}"
        losses.append(loss)
    return np.array(losses)


def node_by_node_calls(stats) -> int:
    """The calls a hierarchical all-reduce made (mpi_tp.parallel.hierarchical: its groups are named
    "<group>_intra" and "<group>_inter"): the proof that a reduction went node by node, not flat."""
    return sum(n for key, n in stats.calls.items() if key.split("/")[0].endswith(("_intra", "_inter")))


def assert_losses(losses, ref_losses, what):
    """A parallel run's losses against the serial model's: the first within 1e-10, every one within 1e-8."""
    assert_close(losses[:1], ref_losses[:1], 1e-10, f"first loss, {what}")
    assert_close(losses, ref_losses, 1e-8, f"losses, {what}")


def compared(params):
    """The parameters to compare with the serial model's: attn/k/bias left out (its gradient is exactly 0,
    so its value is rounding noise: docs/tensor_parallelism.md)."""
    return [p for p in params if not p.name.endswith("attn/k/bias")]
