"""mpi_tp: Megatron-style tensor parallelism for GPT-like transformers in NumPy/CuPy + mpi4py.

Start with `mpi_tp.layers` (the column and row split), then `mpi_tp.model`.
"""
__version__ = "0.1.0"
