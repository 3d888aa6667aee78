"""Exercise 5: predict the bytes of one step.

One forward and one backward pass of a GPT block (attention and MLP, plain
tensor parallelism, no sequence parallelism) on an input (B, S, C) at T ranks,
itemsize bytes per number. Predict what the counters of the tensor-parallel
collectives (mpi_tp.parallel.collectives.CommStats) add up to:

- buffer bytes: the size of the array handed to each collective, summed;
- wire bytes: what one rank sends over its links if each collective is a ring.

Write both as formulas of B, S, C, T and itemsize, then check them against the
counters of a real block at the job's world size:

    mpiexec -n 2 mpi-tp exercise 5 --file exercise5.py

Read docs/notation.md ("Bytes") first. The lesson: mpiexec -n 2 mpi-tp explain --layer block
"""

# ======== EXERCISE 5: fix these two predictions ========


def buffer_bytes(B, S, C, T, itemsize):
    """Buffer bytes of the tensor-parallel collectives of one forward + backward of one block."""
    return 2 * B * S * C * itemsize


def wire_bytes(B, S, C, T, itemsize):
    """Wire bytes (ring algorithm) that one rank sends in the same forward + backward."""
    return buffer_bytes(B, S, C, T, itemsize) * (T - 1) / T

# ======== end of EXERCISE 5 ========
