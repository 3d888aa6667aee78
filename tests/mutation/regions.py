"""Tensor parallelism's regions and layers: f and g, the row layer's bias, the vocabulary's split."""
from mutation.mutant import Mutant

MUTANTS = [
    Mutant("regions/f-backward-skips-all-reduce",
           "f's backward returns this rank's partial dX instead of the sum over the group",
           "mpi_tp/parallel/tensor_parallel.py",
           "def copy_to_tp_backward(dout, group: Group):\n    \"\"\"", "def copy_to_tp_backward(dout, group: Group):\n"
           "    return dout\n    \"\"\"",
           ("tests/test_layers.py::test_column_parallel_linear",), (2,)),
    Mutant("regions/g-forward-skips-all-reduce",
           "g's forward returns this rank's partial sum: the row layer's output is not summed",
           "mpi_tp/parallel/tensor_parallel.py",
           "    return group.all_reduce(x)", "    return x",
           ("tests/test_layers.py::test_row_parallel_linear",), (2,)),
    Mutant("regions/row-bias-before-reduce",
           "the row layer adds its (replicated) bias before the reduce: T copies of b in the sum",
           "mpi_tp/model/parallel_linear.py",
           "        early = self.bias is not None and self.group.size > 1 and planted(\"bug-bias-before-reduce\")",
           "        early = self.bias is not None and self.group.size > 1",
           ("tests/test_layers.py::test_row_parallel_linear",), (2,)),
    Mutant("regions/vocab-offset-dropped",
           "the parallel embedding looks its ids up without subtracting its vocabulary start",
           "mpi_tp/model/parallel_embedding.py",
           "        local = ids - self.start ", "        local = ids - 0 ",
           ("tests/test_layers.py::test_vocab_parallel_embedding_and_tied_head",), (2,)),
    Mutant("regions/cross-entropy-target-offset",
           "the parallel cross-entropy finds the target's logit without its shard's offset",
           "mpi_tp/model/parallel_cross_entropy.py",
           "        col = targets.reshape(-1) - self.start ", "        col = targets.reshape(-1) - 0 ",
           ("tests/test_layers.py::test_vocab_parallel_cross_entropy",), (2,)),
]
