"""Sequence parallelism: the norms' weight gradients summed over tp, the layers' kept shard, the overlap."""
from mutation.mutant import Mutant

MUTANTS = [
    Mutant("sequence/norm-grads-not-summed",
           "the gradients of weights every rank applies to its own positions (norms, row biases) are not "
           "summed over tp",
           "mpi_tp/parallel/data_parallel.py",
           "            self.tp.all_reduce(b.grads[b.sp], kind=\"sp_grad_all_reduce\")",
           "            pass",
           ("tests/test_layouts.py::test_sp_and_zero_equal_serial",), (2,)),
    Mutant("sequence/keeps-the-gathered-input",
           "a column layer keeps the gathered (B, S, K) input instead of its (B, S_i, K) shard",
           "mpi_tp/model/parallel_linear.py",
           "    kept = x_in if seq is None else x ", "    kept = x_in if seq is None else x_in ",
           ("tests/test_layouts.py::test_activation_memory",), (2,)),
    Mutant("sequence/overlap-never-runs",
           "the column layers' cache forgets the overlap flag: Megatron's overlapped backward never runs",
           "mpi_tp/model/parallel_linear.py",
           "    return y, (kept, has_bias, seq, sp is not None and sp.overlap)",
           "    return y, (kept, has_bias, seq, False)",
           ("tests/test_layouts.py::test_sequence_parallel_overlap_changes_no_number",), (2, 3)),
]
