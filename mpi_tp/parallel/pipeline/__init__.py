"""Pipeline parallelism: the model's blocks in stages on different ranks, micro-batches flowing through.
`stages` says which blocks each stage holds, `schedules` holds the schedules as data (GPipe, 1F1B,
interleaved) and plays them, `engine` runs one stage's schedule with Isend/Irecv between stages,
`stage` is a stage's training step over the model chunks it is given (mpi_tp.model.chunks builds them),
`wire` what travels between stages, `embedding_group` the tied table's copies on the first and last."""
