"""Pipeline parallelism: the model's layers in stages on different ranks, micro-batches flowing through.
`schedules` holds the schedules as data (GPipe, 1F1B, interleaved) and plays them."""
