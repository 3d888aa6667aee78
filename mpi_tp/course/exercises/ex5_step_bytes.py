"""Exercise 5: predict the bytes of one training step.

One training step of a GPT of L blocks and a vocabulary of V tokens, plain
tensor parallelism at T ranks (no sequence, data or pipeline parallelism), on a
batch of B sequences of S positions, C channels, itemsize bytes per number:
the embedding, the blocks, the tied output layer and the loss forward, the
backward pass, and the gradient norm (a float64 sum of squares). Predict what
the counters of the tensor-parallel collectives (CommStats, in
mpi_tp/parallel/comm_stats.py) add up to over the step:

- buffer bytes: the size of the array handed to each collective, summed;
- wire bytes: what one rank sends over its links if each collective is a ring.

Write both as formulas of B, S, C, V, L, T and itemsize (not every one of them
need matter), then check them against the counters of a real step at the job's
world size:

    mpiexec -n 2 mpi-tp exercise 5 --file exercise5.py

Read docs/notation.md ("Bytes") first. The lessons: mpiexec -n 2 mpi-tp explain --layer block,
then --layer embedding, --layer loss and --layer step (which gives the answer: try first).
"""

# ======== EXERCISE 5: fix these two predictions ========


def buffer_bytes(B, S, C, V, L, T, itemsize):
    """Buffer bytes of the tensor-parallel collectives of one training step."""
    return 2 * L * B * S * C * itemsize


def wire_bytes(B, S, C, V, L, T, itemsize):
    """Wire bytes (ring algorithm) that one rank sends in the same step."""
    return buffer_bytes(B, S, C, V, L, T, itemsize) * (T - 1) / T

# ======== end of EXERCISE 5 ========
