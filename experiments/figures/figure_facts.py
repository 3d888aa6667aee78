"""Facts for the figures of docs/learn.md, read from the project's own layers and counters
(experiments/figures/figures.py).

Each function builds real layers on the given group, runs a forward and a
backward pass, and returns which slices each rank holds and which collectives
were counted: nothing in a picture is typed in by hand.
"""
import numpy as np

from mpi_tp.model.block import Block
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.forward_pass import Pass
from mpi_tp.model.gpt import GPT
from mpi_tp.model.parallel_cross_entropy import VocabParallelCrossEntropy
from mpi_tp.model.parallel_embedding import VocabParallelEmbedding
from mpi_tp.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from mpi_tp.parallel.finalize import finalize_grads, sum_sp_partial_grads
from mpi_tp.parallel.topology import Topology


def counted(stats, fn):
    """Run fn() with fresh counters: (its result, {kind: (calls, bytes, wire bytes)} it communicated)."""
    stats.reset()
    result = fn()
    return result, {k.split("/", 1)[1]: (v["calls"], v["bytes"], v["wire_bytes"])
                    for k, v in stats.snapshot().items()}


def linear_facts(group):
    """ColumnParallelLinear(6 -> 7) followed by RowParallelLinear(7 -> 6), as in an MLP."""
    col = ColumnParallelLinear("demo/fc", 6, 7, group, "float64")
    row = RowParallelLinear("demo/proj", 7, 6, group, "float64", sizes=col.sizes)
    x = np.random.default_rng(0).standard_normal((1, 4, 6))           # (B, S, K): 4 tokens
    y, col_fwd = counted(group.stats, lambda: col.forward(x))          # (1, 4, O_i)
    _, col_bwd = counted(group.stats, lambda: col.backward(np.ones_like(y)))
    z, row_fwd = counted(group.stats, lambda: row.forward(y))          # (1, 4, 6), all-reduced
    _, row_bwd = counted(group.stats, lambda: row.backward(np.ones_like(z)))
    w, rw = col.weight, row.weight
    return {"col_w": (w.axis, w.start, w.stop, w.data.shape), "col_y": y.shape,
            "row_w": (rw.axis, rw.start, rw.stop, rw.data.shape), "row_z": z.shape,
            "col_fwd": col_fwd, "col_bwd": col_bwd, "row_fwd": row_fwd, "row_bwd": row_bwd}


def block_facts(comm, sp: bool):
    """One Block (5 heads, C = 20, MLP width 80) on the 3-rank group: who holds what, what it sends."""
    topo = Topology.create(comm)
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=5, n_embd=20)
    block = Block(0, cfg, topo, np.dtype("float64"), 0, sp)
    S = cfg.block_size
    ps = Pass.start(topo, S, sp)                                        # the micro-batch's pass
    rows = slice(0, S) if ps.sp is None else ps.sp.positions           # this rank's positions
    x = np.random.default_rng(1).standard_normal((2, S, cfg.n_embd))[:, rows].copy()
    y, fwd = counted(topo.stats, lambda: block.forward(x, ps))
    _, bwd = counted(topo.stats, lambda: (block.backward(np.ones_like(y)),          # then, as finalize_grads
                                          sum_sp_partial_grads(block.parameters(), topo.tp)))
    attn, mlp = block.attn, block.mlp
    facts = {"heads": (attn.heads.start, attn.heads.stop), "head_size": attn.hs,
             "qkv_cols": (attn.qkv.weight.start, attn.qkv.weight.stop),
             "fc_cols": (mlp.fc.weight.start, mlp.fc.weight.stop),
             "positions": (rows.start, rows.stop), "fwd": fwd, "bwd": bwd}
    topo.free()
    return facts


def vocab_facts(group):
    """VocabParallelEmbedding (V = 10, C = 4), its tied head and the vocab-parallel loss."""
    emb = VocabParallelEmbedding("wte", 10, 4, group, "float64")
    loss = VocabParallelCrossEntropy(group, emb.start, emb.stop)
    ids, targets = np.array([[3, 7, 0, 5, 9]]), np.array([[7, 0, 5, 9, 2]])
    x, emb_fwd = counted(group.stats, lambda: emb.forward(ids))                  # (1, 5, C), whole
    logits, head_fwd = counted(group.stats, lambda: emb.logits_forward(x))       # (1, 5, V_i)
    _, loss_fwd = counted(group.stats, lambda: loss.forward(logits, targets))
    dlogits, loss_bwd = counted(group.stats, loss.backward)
    dx, head_bwd = counted(group.stats, lambda: emb.logits_backward(dlogits))
    _, emb_bwd = counted(group.stats, lambda: emb.backward(dx))
    return {"rows": (emb.start, emb.stop), "ids": ids[0].tolist(), "emb_fwd": emb_fwd, "head_fwd": head_fwd,
            "loss_fwd": loss_fwd, "loss_bwd": loss_bwd, "head_bwd": head_bwd, "emb_bwd": emb_bwd}


STEP = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
STEP_B = 4


def step_counters(comm, sp: bool):
    """Counters of one forward and one backward of a small GPT on `comm` (2 ranks), the backward followed by
    finalize_grads (the sequence-parallel sums of the replicated gradients)."""
    topo = Topology.create(comm)
    model = GPT(GPTConfig(**STEP), topo, sequence_parallel=sp)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (STEP_B, STEP["block_size"])), rng.integers(0, 256, (STEP_B, STEP["block_size"]))
    _, fwd = counted(topo.stats, lambda: model.forward(x, y))
    _, bwd = counted(topo.stats, lambda: (model.backward(), finalize_grads(model)))
    topo.free()
    return {"fwd": fwd, "bwd": bwd}
