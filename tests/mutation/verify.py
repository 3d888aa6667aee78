"""mpi-tp verify: what lets it name the place of a difference (the layers' outputs, the backward order)."""
from mutation.mutant import Mutant

BUG_TEST = "tests/test_verify.py::test_a_planted_bug_is_found_and_named"

MUTANTS = [
    Mutant("verify/no-layer-compared",
           "verify records the layers' outputs but compares none: every forward 'agrees'",
           "mpi_tp/verify/activations.py",
           "    for (layer, row0), (got, ps) in parallel.outputs.items():",
           "    for (layer, row0), (got, ps) in []:",
           (BUG_TEST + "[bug-vocab-offset]",), (1,)),
    Mutant("verify/gradients-in-model-order",
           "verify names the first differing gradient in model order (embeddings first), not the backward's",
           "mpi_tp/verify/run.py",
           "    return sorted(names, key=key)", "    return sorted(names)",
           (BUG_TEST + "[bug-dropout-replay]",), (1,)),
    Mutant("verify/zero-shares-skipped",
           "verify compares no gradient held in a ZeRO-1 share (only whole storages)",
           "mpi_tp/verify/shards.py",
           "    for space in opt.spaces:", "    for space in [s for s in opt.spaces if s.bucket is None]:",
           ("tests/test_verify.py::test_every_layout_verifies",), (2,)),
]
