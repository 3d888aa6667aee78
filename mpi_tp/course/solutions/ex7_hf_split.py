"""Exercise 7, solved: the heads of a rank when there are fewer key/value heads than ranks.

With H_kv >= T the key/value heads are shared out (split_sizes) and each rank
holds the R = H / H_kv query heads of each of its key/value heads. With
H_kv < T that would leave some ranks with no key/value head and so no query
head: instead the ranks are shared out among the key/value heads
(split_sizes(T, H_kv) consecutive ranks per head), a head's R query heads among
its ranks, and every rank holds a replica of the one key/value head its query
heads read (mpi_tp/model/heads.py; Megatron-LM and vLLM do the same). So
k_proj's and v_proj's rows are the same on the ranks of one head, while
q_proj's and o_proj's never overlap. The rest is the column, row and
vocabulary split of the layers, transposed: torch.nn.Linear stores (out, in).
"""
from mpi_tp.parallel.topology import offsets, split_sizes


def share(n, T, i):
    """(start, stop): rank i's share of n things split over T ranks."""
    sizes = split_sizes(n, T)
    return offsets(sizes)[i], offsets(sizes)[i] + sizes[i]


def heads(H, H_kv, T, rank):
    """(query heads, key/value heads) of `rank`: two ranges of head indices."""
    R = H // H_kv
    if H_kv >= T:
        kv = range(*share(H_kv, T, rank))
        return range(kv.start * R, kv.stop * R), kv
    per_head = split_sizes(T, H_kv)                       # how many ranks hold each key/value head
    head = next(h for h, first in enumerate(offsets(per_head)) if first <= rank < first + per_head[h])
    a, b = share(R, per_head[head], rank - offsets(per_head)[head])    # this rank's part of the head's R
    return range(head * R + a, head * R + b), range(head, head + 1)


def shard(name, shape, H, H_kv, T, rank):
    """What rank `rank` of T holds of the Hugging Face tensor `name` (of `shape`): (axis, start, stop), the
    rows (axis 0) or columns (axis 1) [start, stop), or None when it holds the whole tensor."""
    part = name.split(".")[-2]                            # "q_proj", "embed_tokens", "norm", ...
    q, kv = heads(H, H_kv, T, rank)
    if part == "q_proj":
        hs = shape[0] // H
        return 0, q.start * hs, q.stop * hs
    if part in ("k_proj", "v_proj"):
        hs = shape[0] // H_kv
        return 0, kv.start * hs, kv.stop * hs
    if part == "o_proj":
        hs = shape[1] // H
        return 1, q.start * hs, q.stop * hs
    if part in ("gate_proj", "up_proj"):
        return (0, *share(shape[0], T, rank))
    if part == "down_proj":
        return (1, *share(shape[1], T, rank))
    if part in ("embed_tokens", "lm_head"):
        return (0, *share(shape[0], T, rank))
    return None                                           # the norms
