"""Data parallelism: the hierarchical all-reduce, ZeRO-1's reduce-scatter and all-gather, and the memory
accounting of its buckets (a parameter's gradient is a view into one: counted once)."""
from mutation.mutant import Mutant

HIERARCHICAL = "                    self.hierarchical[b.group.name].all_reduce(b.grads)"
FLAT = "                    b.group.all_reduce(b.grads)"

MUTANTS = [
    Mutant("data_parallel/hierarchical-reduces-flat",
           "GradReducer(hierarchical=True) reduces each bucket flat instead of node by node",
           "mpi_tp/parallel/data_parallel.py", HIERARCHICAL, FLAT,
           ("tests/test_hierarchical.py::test_training_with_hierarchical_dp",), (2, 4)),
    Mutant("data_parallel/hierarchical-moe-reduces-flat",
           "the same break, caught by the MoE layouts' test (expert buckets over edp)",
           "mpi_tp/parallel/data_parallel.py", HIERARCHICAL, FLAT,
           ("tests/test_moe.py::test_hierarchical_reduction_matches_flat",), (2, 4)),
    Mutant("data_parallel/hierarchical-pipeline-reduces-flat",
           "the same break, caught by the pipelined test (reduction after the schedule)",
           "mpi_tp/parallel/data_parallel.py", HIERARCHICAL, FLAT,
           ("tests/test_pipeline_dp_overlap.py::test_hierarchical_reduces_after_the_schedule",), (2, 4)),
    Mutant("data_parallel/memory-counts-bucket-views-twice",
           "the memory meter counts a view as its own array: every gradient once in its bucket, again as the "
           "parameter's grad_base",
           "mpi_tp/core/memory.py", "        a = a.base\n", "        break\n",
           ("tests/test_memory_accounting.py::test_model_state_categories_equal_their_closed_forms",), (2,)),
]
