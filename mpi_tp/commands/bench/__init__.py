"""`mpi-tp bench`: timed measurements against this machine's limits, one module per kind.

    command.py     the command: its options, the shapes, which measurement runs them
    step.py        training steps (--sweep, --zero 1, --precision; activation bytes per layer)
    accounting.py  memory per rank by kind and wire bytes by role, at the width of --precision
    yardsticks.py  the GEMM peak, a bare all-reduce, model FLOPs, the environment
    pipeline.py    pipelined steps (--pp): the bubble and the stage-to-stage bytes
    inference.py   cached decoding (--inference): prefill, decode steps, the memory limit
    moe.py         a mixture-of-experts MLP beside a dense one of the same active FLOPs (--moe)
"""
from mpi_tp.commands.bench.command import add_parser
from mpi_tp.commands.bench.yardsticks import environment

__all__ = ["add_parser", "environment"]
