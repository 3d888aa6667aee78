"""The training command's plumbing: the options of a layout reach the model, the reducer and the optimizer."""
from mutation.mutant import Mutant

TRAIN_TESTS = ("tests/test_train_flags.py",)       # jobs of 2 ranks each, started by the one-rank pytest

MUTANTS = [
    Mutant("build/sequence-parallel-dropped",
           "mpi-tp train --sequence-parallel builds a model without sequence parallelism",
           "mpi_tp/training/build.py",
           "                    sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute)",
           "                    sequence_parallel=False, recompute=cfg.recompute)",
           TRAIN_TESTS, (1,)),
    Mutant("build/zero-dropped",
           "mpi-tp train --zero 1 keeps the whole optimizer state on every replica",
           "mpi_tp/training/build.py",
           "                          distributed=bool(cfg.zero), stage=max(cfg.zero, 1))",
           "                          distributed=False, stage=max(cfg.zero, 1))",
           TRAIN_TESTS, (1,)),
    Mutant("build/recompute-dropped",
           "mpi-tp train --recompute full keeps every activation",
           "mpi_tp/training/build.py",
           "                    sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute)",
           "                    sequence_parallel=cfg.sequence_parallel, recompute=\"none\")",
           TRAIN_TESTS, (1,)),
]
