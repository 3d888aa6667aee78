"""mpi_tp: Megatron-style tensor parallelism for GPT-like transformers in NumPy/CuPy + mpi4py.

The folders import only downward, from the ground up:

    core/        array backend and GPU staging, kernels, parameter shards, layer base, MPI runtime
    text/        tokenizers (bytes, tokenizer.json), token files, ids to text as they come
    parallel/    process grid, counted collectives, tensor- / sequence- / context- / data-parallel regions
    model/       the parallel layers (column and row split: parallel_linear.py) and the GPT
    checkpoint/  sharded HDF5 checkpoints: write, read
    inference/   sampling
    training/    configuration, data, optimizers, pre-emption, the training loop
    planning/    cost model, calibration, layout planner
    commands/    the `mpi-tp` subcommands

Start with `mpi_tp.model.parallel_linear` (the column and row split), then
`mpi_tp.parallel.tensor_parallel` (where they communicate) and `mpi_tp.model.gpt`.
"""
__version__ = "0.1.0"
