"""`mpi-tp explain`: live lessons, each a tiny layer or step split over the ranks and checked
against its serial self, one module per subject.

    layers.py     the column and row layers, the MLP, attention, a block (the command's parser)
    vocab.py      the embedding and the vocab-parallel loss
    step.py       one whole training step, phase by phase (TP, SP, DP, pipelines, experts)
    pipeline.py   the pipeline schedules, drawn from the run's own timestamps
    moe.py        a mixture-of-experts layer at ep = world size
    precision.py  a block's activation bytes and 16 bytes per parameter at bf16 beside fp32
    ring.py       context parallelism: ring attention at cp = world size, its causal grid, work and bytes
    common.py     the wire-byte closed forms and the collective lines every lesson prints
"""
from mpi_tp.commands.explain.layers import add_parser, cmd_explain

__all__ = ["add_parser", "cmd_explain"]
