"""Checkpoints: loading at another layout."""
from mutation.mutant import Mutant

MUTANTS = [
    Mutant("checkpoint/load-reads-but-never-stores",
           "load_into reads each shard from the checkpoint but leaves the model's weights as they were",
           "mpi_tp/checkpoint/read.py",
           "        p.data[...] = read(\"model\", p, p.data.shape, p.data.dtype)",
           "        read(\"model\", p, p.data.shape, p.data.dtype)",
           ("tests/test_checkpoint.py::test_load_at_every_smaller_size",), (1, 2, 3)),
]
