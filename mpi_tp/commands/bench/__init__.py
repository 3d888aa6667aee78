"""`mpi-tp bench`: timed measurements against this machine's limits, one module per kind.

    step.py        training steps (the command's parser, the GEMM and memory yardsticks, --sweep)
    pipeline.py    pipelined steps (--pp): the bubble and the stage-to-stage bytes
    inference.py   cached decoding (--inference): prefill, decode steps, the memory limit
    moe.py         a mixture-of-experts MLP beside a dense one of the same active FLOPs (--moe)
"""
from mpi_tp.commands.bench.step import add_parser, environment

__all__ = ["add_parser", "environment"]
