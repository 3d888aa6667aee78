"""Exercise 5, solved: four all-reduces of one (B, S, C) activation, and a ring's 2 (T-1)/T.

A block has two g's forward (after attention, after the MLP) and two f's
backward (before q/k/v and before fc); each all-reduces B S C numbers. At T = 1
nothing is communicated and the counters stay empty. A ring all-reduce of n
buffer bytes sends 2 (T-1)/T n bytes from each rank.
"""


def buffer_bytes(B, S, C, T, itemsize):
    """Buffer bytes of the tensor-parallel collectives of one forward + backward of one block."""
    return 0 if T == 1 else 4 * B * S * C * itemsize


def wire_bytes(B, S, C, T, itemsize):
    """Wire bytes (ring algorithm) that one rank sends in the same forward + backward."""
    return 4 * 2 * (T - 1) / T * B * S * C * itemsize
