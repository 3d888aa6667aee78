"""Exercise 8, solved: ZeRO-1 moves no more bytes than the all-reduce, and keeps 1/D of the state.

A ring all-reduce of n buffer bytes is a reduce-scatter and then an all-gather,
each sending (D-1)/D n from every rank: 2 (D-1)/D num_params grad_bytes for the gradients.
ZeRO-1 runs the same two halves with the update between them: the
reduce-scatter carries gradients, (D-1)/D num_params grad_bytes, and the all-gather the
updated parameters, (D-1)/D num_params param_bytes. The same bytes when the two widths
are equal; fewer when the gradients are wider than the parameters (bf16 with
fp32 gradients: 6 bytes a value instead of 8). The buckets (how many, how cut)
do not matter: each counts (D-1)/D of its own buffer.

AdamW keeps m and v for every value it updates, in fp32 for 16-bit parameters
(with fp32 masters besides: 12 bytes a value), at the parameters' width
otherwise (2 of them). With ZeRO-1 a rank updates 1/D of the values, so it
keeps 1/D of that (its share of a bucket may be one element more or less).
"""


def dp_wire_bytes(num_params, D, grad_bytes, param_bytes, zero):
    """Wire bytes one rank sends for the gradients (and, with ZeRO-1, the parameters) in one step."""
    ring = (D - 1) / D * num_params              # one ring pass: a reduce-scatter or an all-gather
    if zero:
        return ring * grad_bytes + ring * param_bytes
    return 2 * ring * grad_bytes


def state_bytes(num_params, D, grad_bytes, param_bytes, zero):
    """Bytes of optimizer state one rank keeps."""
    per_value = 12 if param_bytes < 4 else 2 * param_bytes      # masters, m, v in fp32; or m, v
    return per_value * num_params / (D if zero else 1)
