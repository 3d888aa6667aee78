"""Pipeline parallelism: the model's blocks in stages on different ranks, micro-batches flowing through.
`stages` says which blocks each stage holds, `schedules` holds the schedules as data (GPipe, 1F1B,
interleaved) and plays them, `engine` runs one stage's schedule with Isend/Irecv between stages.
The model side (chunks of the GPT, the tied embedding's two copies) is mpi_tp.parallel.pipeline.stage."""
