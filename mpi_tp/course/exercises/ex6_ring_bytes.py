"""Exercise 6: predict one layer of ring attention: its messages, its bytes, its work.

Context parallelism at Z ranks (mpi-tp train --cp Z): the sequence of S
positions is cut into 2Z chunks (sizes differ by at most one, the first
S % 2Z one position longer: mpi_tp.parallel.topology.split_sizes), and rank r
holds chunks r and 2Z - 1 - r, one from each end (S_r positions in all). One
causal attention of B sequences, H query heads and H_kv key/value heads of
hs values each (grouped-query attention when H_kv < H) runs as ring
attention: each rank keeps its queries while the keys and values go around
the ring r -> r + 1; at step s = 0 ... Z-1 rank r holds rank r - s's
(mod Z). The backward pass sends them around again, with their gradients.
Predict, for one layer, forward and backward:

- messages(Z): the sends of one rank, as (forward, backward);
- sent_bytes(B, H, H_kv, S, hs, Z, r, itemsize): the bytes rank r sends;
- scores(S, Z, r, s): the (query position, key position) scores rank r
  computes at ring step s in the forward pass, per sequence and head; a
  block on the diagonal (the same chunk) is computed whole and then masked,
  so count it whole.

Not every argument need matter. Check them against the counters and the
blocks of a real ring at Z = the job's world size, at two shapes (S = 13,
which 2Z never divides, and grouped-query attention in float32):

    mpiexec -n 2 mpi-tp exercise 6 --file exercise6.py

Read the docstrings of mpi_tp/parallel/context_parallel.py and
ring_attention.py first. mpiexec -n 2 mpi-tp explain --layer cp prints the
answer for its own shapes: try first.
"""

# ======== EXERCISE 6: fix these three predictions ========


def messages(Z):
    """(forward, backward): the sends of one rank in one layer."""
    return Z - 1, Z - 1


def sent_bytes(B, H, H_kv, S, hs, Z, r, itemsize):
    """The bytes rank r sends in one layer, forward and backward."""
    forward, backward = messages(Z)
    return (forward + backward) * 2 * B * H * (S // Z) * hs * itemsize


def scores(S, Z, r, s):
    """The scores rank r computes at ring step s (a diagonal block counted whole)."""
    mine = S // Z                       # rank r: positions r S/Z ... (r + 1) S/Z - 1
    src = (r - s) % Z                   # whose keys rank r holds at step s
    return mine * mine if src <= r else 0

# ======== end of EXERCISE 6 ========
