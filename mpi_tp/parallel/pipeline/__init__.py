"""Pipeline parallelism: the model's blocks in stages on different ranks, micro-batches flowing through.
`stages` says which blocks each stage holds, `schedules` holds the schedules as data (GPipe, 1F1B,
interleaved) and plays them; stages exchange activations with Group.isend / Group.irecv
(mpi_tp.parallel.collectives). The engine that runs a pipelined GPT is not written yet."""
