"""Exercise 5, solved: the all-reduces of one training step under plain tensor parallelism.

Forward: the embedding's g (one (B, S, C) activation) and each block's two g's
(after attention, after the MLP); the loss never gathers the logits, it
all-reduces the B S row maxima and then 2 B S sums (the sum of exponentials and
the target's logit, fused). Backward: each block's two f's (before q/k/v and
before fc) and the tied output layer's f, one (B, S, C) gradient each; the
embedding's backward needs nothing. Then the gradient norm: one float64 number.
V does not appear: the vocabulary stays split. At T = 1 nothing is
communicated. Every collective is an all-reduce, and a ring all-reduce of n
buffer bytes sends 2 (T-1)/T n bytes from each rank.
"""


def buffer_bytes(B, S, C, V, L, T, itemsize):
    """Buffer bytes of the tensor-parallel collectives of one training step."""
    if T == 1:
        return 0
    activations = (2 * L + 1) + (2 * L + 1)          # g's forward, f's backward: (B, S, C) each
    return (activations * B * S * C + 3 * B * S) * itemsize + 8


def wire_bytes(B, S, C, V, L, T, itemsize):
    """Wire bytes (ring algorithm) that one rank sends in the same step."""
    return 2 * (T - 1) / T * buffer_bytes(B, S, C, V, L, T, itemsize)
