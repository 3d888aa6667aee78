"""Exercise 7: which rows or columns of each Hugging Face tensor rank i holds.

`mpi-tp import-hf` run at T ranks has each rank read only its own slice of each
tensor of a LlamaForCausalLM folder (mpi_tp/checkpoint/hf/names.py lists them).
torch.nn.Linear stores a weight (out, in), the transpose of mpi_tp's (in, out),
so a column split in mpi_tp is a split of the rows here:

    q_proj (H hs, C), k_proj and v_proj (H_kv hs, C)   rows: the rank's heads (hs rows each)
    o_proj (C, H hs)                                    columns: the rank's query heads
    gate_proj and up_proj (F, C)                        rows: the rank's share of F
    down_proj (C, F)                                    columns: the same share of F
    embed_tokens and lm_head (V, C)                     rows: the rank's share of the vocabulary
    the norms (C,)                                      whole on every rank

Shares of F and V differ by at most one: the first n % T ranks hold one more
(mpi_tp.parallel.topology.split_sizes). Query head h reads key/value head
h // R, R = H / H_kv, and a rank holds the key/value heads its query heads read.

With grouped-query attention this `shard` is wrong for some models at some T.
Fix it, then check it against the real model's shards at T = 3 (and 2 and 4):

    mpiexec -n 3 mpi-tp exercise 7 --file exercise7.py

Lesson: docs/course.md, lesson 13; mpi_tp/model/heads.py once you have tried.
"""
from mpi_tp.parallel.topology import offsets, split_sizes

# ======== EXERCISE 7: fix shard (and the helpers it calls) ========


def share(n, T, i):
    """(start, stop): rank i's share of n things split over T ranks."""
    sizes = split_sizes(n, T)
    return offsets(sizes)[i], offsets(sizes)[i] + sizes[i]


def heads(H, H_kv, T, rank):
    """(query heads, key/value heads) of `rank`: two ranges of head indices."""
    R = H // H_kv
    kv = range(*share(H_kv, T, rank))                     # the key/value heads, shared out as the q heads are
    return range(kv.start * R, kv.stop * R), kv           # and the R query heads of each


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

# ======== end of EXERCISE 7 ========
