"""Exercise 6, solved: one layer of ring attention under the two-ends split.

Forward: at each step but the last a rank passes on the K/V block it holds
(Z - 1 sends). Backward: the blocks go around again (Z - 1 sends) and their
gradients dK, dV travel with them, one hop more, so that they come home to the
rank that owns them (Z sends): 3Z - 2 in all, none at Z = 1. A message is K
and V (or dK and dV) of the block held, rank r - s's: 2 B H_kv S_(r-s) hs
values (H_kv heads, not H: each key/value head serves H / H_kv query heads).
The Z gradient messages carry every rank's block once, S positions.

The scores: rank r holds chunk a, which is r, and chunk b, which is 2Z - 1 - r. At step 0 (its own
keys) the pairs (a, a), (b, a), (b, b); against a lower rank's chunks a' < a
and b' > b, both of its chunks see a' (and neither sees b'); against a higher
rank's, a' > a and b' < b, only b sees both. No argument but S, Z, r, s counts:
grouped-query attention shrinks the messages, not the arithmetic.
"""


def _chunks(S, Z):
    """The 2Z chunk sizes: the first S % 2Z one position longer."""
    base, extra = divmod(S, 2 * Z)
    return [base + 1 if i < extra else base for i in range(2 * Z)]


def _held(S, Z, r):
    """S_r: the positions rank r holds (chunks r and 2Z - 1 - r)."""
    n = _chunks(S, Z)
    return n[r] + n[2 * Z - 1 - r]


def messages(Z):
    """(forward, backward): the sends of one rank in one layer."""
    return Z - 1, (Z - 1) + Z if Z > 1 else 0


def sent_bytes(B, H, H_kv, S, hs, Z, r, itemsize):
    """The bytes rank r sends in one layer, forward and backward."""
    if Z == 1:
        return 0
    per = 2 * B * H_kv * hs * itemsize                          # K and V (or dK and dV) of one position
    kv = sum(_held(S, Z, (r - s) % Z) for s in range(Z - 1))    # the blocks passed on, forward
    return per * (kv + kv + S)                                  # again backward, and every gradient once


def scores(S, Z, r, s):
    """The scores rank r computes at ring step s (a diagonal block counted whole)."""
    n = _chunks(S, Z)
    a, b = n[r], n[2 * Z - 1 - r]
    src = (r - s) % Z
    a2, b2 = n[src], n[2 * Z - 1 - src]
    if src == r:
        return a * a + b * a + b * b
    if src < r:
        return (a + b) * a2
    return b * (a2 + b2)
