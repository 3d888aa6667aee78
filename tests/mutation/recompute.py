"""Activation recomputation and dropout: the blocks that recompute, the masks that must come back the same."""
from mutation.mutant import Mutant

MUTANTS = [
    Mutant("recompute/moe-blocks-never-recompute",
           "--recompute full leaves the MoE blocks keeping their activations",
           "mpi_tp/model/gpt.py",
           "            block.recompute = recompute == \"full\"",
           "            block.recompute = recompute == \"full\" and not block.moe",
           ("tests/test_moe.py::test_recompute_full_gives_the_same_gradients",), (1, 2)),
    Mutant("recompute/dropout-never-applied",
           "dropout draws no mask even while training",
           "mpi_tp/model/dropout.py",
           "        return self.training and self.p > 0", "        return False",
           ("tests/test_model.py::test_dropout_matches_serial",), (1, 2)),
    Mutant("recompute/eval-ignored",
           "model.eval() leaves dropout on",
           "mpi_tp/model/gpt.py",
           "        self.dropout.training = mode", "        self.dropout.training = True",
           ("tests/test_model.py::test_dropout_matches_serial",), (1, 2)),
]
