"""The check of exercise 7: the student's slice of every Hugging Face tensor against the real model's shards.

At T = world size, three small Llama models (grouped-query attention with
H_kv = H / 2, multi-query attention with H_kv = 1 and a tied output layer, and
H = 6 heads over H_kv = 3 with an MLP width and a vocabulary that no T >= 2
divides) are built as `mpi-tp train` and `import-hf` build them. For each
parameter, the rows or columns of its Hugging Face tensor that this rank holds
are what `import-hf` reads: mpi_tp.checkpoint.hf.names.region of the Param's
axis, start and stop (the transposition of torch.nn.Linear included). Each rank
compares them with shard(name, shape, H, H_kv, T, rank) of the student's file
and reports its first wrong tensor, what it said, what it holds, and why.
"""
from __future__ import annotations

import numpy

from mpi_tp.checkpoint.hf.names import hf_shapes, pieces, region
from mpi_tp.core.errors import UserError
from mpi_tp.core.testing import all_true
from mpi_tp.course.common import SEED, Feedback, finish, needs_ranks
from mpi_tp.model.config import GPTConfig
from mpi_tp.model.gpt import GPT
from mpi_tp.model.heads import head_layout
from mpi_tp.parallel.topology import Topology

V = 37                                          # prime: the vocabulary rows are uneven at every T >= 2
MODELS = ((32, 4, 2, None, False),              # (C, H, H_kv, F, tied): lesson 13's model (F = 88)
          (32, 4, 1, None, True),               # multi-query: one key/value head, H_kv < T from T = 2
          (48, 6, 3, 50, False))                # heads uneven at T = 2, H_kv < T at T = 4
MAX_RANKS = min(H for _, H, _, _, _ in MODELS)  # every rank needs a query head
HEADS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _config(C, H, H_kv, F, tied) -> GPTConfig:
    return GPTConfig(arch="llama", vocab_size=V, block_size=8, n_layer=1, n_head=H, n_kv_head=H_kv, n_embd=C,
                     intermediate_size=F, tie_word_embeddings=tied)


def _normal(answer, shape):
    """(axis, start, stop), or None for the whole tensor; ValueError saying what is wrong with the form."""
    if answer is None:
        return None
    if not (isinstance(answer, (tuple, list)) and len(answer) == 3
            and all(isinstance(v, (int, numpy.integer)) for v in answer)):
        raise ValueError(f"returned {answer!r}: give (axis, start, stop), three ints, or None (the whole tensor)")
    axis, start, stop = map(int, answer)
    if not (0 <= axis < len(shape) and 0 <= start <= stop <= shape[axis]):
        raise ValueError(f"returned {answer!r}: no such slice of a tensor of shape {tuple(shape)}")
    return axis, start, stop


def _box(answer, shape) -> tuple:
    """Every axis's [start, stop): (0, 32) then (8, 16) for rows [8, 16) of a (32, 32) tensor, say."""
    return tuple((answer[1], answer[2]) if answer and a == answer[0] else (0, n) for a, n in enumerate(shape))


def _cut(answer, shape) -> int | None:
    """The axis along which `answer` is less than the whole tensor (None: it is the whole)."""
    return next((a for a, (s, n) in enumerate(zip(_box(answer, shape), shape)) if s != (0, n)), None)


def _held(p, piece, shape):
    """What this rank's Param p holds of its Hugging Face tensor, as (axis, start, stop) or None (whole)."""
    idx = region(piece, len(shape), p.axis, p.start, p.stop)
    cut = [(a, s) for a, s in enumerate(idx) if s != slice(None)]
    return (cut[0][0], cut[0][1].start, cut[0][1].stop) if cut else None


def _text(part, answer, shape, H, H_kv) -> str:
    """'rows [8, 16) (key/value head 1)', 'the whole tensor', 'rows [32, 32) (nothing)'."""
    if answer is None:
        return "the whole tensor"
    axis, start, stop = answer
    out = f"{('rows', 'columns')[axis]} [{start}, {stop})"
    if start == stop:
        return out + " (nothing)"
    if part in HEADS and axis == (1 if part == "o_proj" else 0):
        kv = part in ("k_proj", "v_proj")
        hs = shape[axis] // (H_kv if kv else H)
        if start % hs == 0 and stop % hs == 0:
            a, b = start // hs, stop // hs - 1
            out += f" ({'key/value' if kv else 'query'} head{'s' if b > a else ''} {a}{f'-{b}' if b > a else ''})"
    return out


def _why(fb: Feedback, part, said, held, shape, H, H_kv, T) -> None:
    """Notes on what the student's first wrong answer missed (the same text on every rank that makes it)."""
    said_axis, held_axis = _cut(said, shape), _cut(held, shape)
    if held_axis is None:
        fb.note(f"{part}'s weight is replicated: every rank holds it whole (None)")
    elif said_axis is not None and said_axis != held_axis:
        fb.note(f"{part} is cut along axis {held_axis} ({('rows', 'columns')[held_axis]}): torch.nn.Linear "
                "stores a weight (out, in), the transpose of mpi_tp's (in, out), so mpi_tp's column split "
                "(q, k, v, gate, up) cuts the rows here and its row split (o, down) the columns")
    elif part in HEADS:
        lay = head_layout(H, H_kv, T)
        if H_kv < T:
            fb.note(f"H_kv = {H_kv} < T = {T}: sharing out the key/value heads leaves some ranks none, and so no "
                    "query heads; instead the ranks are shared out among the key/value heads, each rank holding "
                    "a replica of the one its query heads read")
        else:
            fb.note(f"H_kv = {H_kv} >= T = {T}: the key/value heads are shared out (split_sizes), each with "
                    f"its R = {H // H_kv} query heads")
        fb.note(f"the heads at H = {H}, H_kv = {H_kv}, T = {T}: " + "; ".join(lay.describe(r) for r in range(T)))
    else:
        fb.note(f"{part}: {shape[held_axis]} {('rows', 'columns')[held_axis]} over T = {T} ranks: split_sizes "
                "gives the first n % T ranks one more, and rank i starts after the shares of ranks 0 ... i-1")


def _check_model(fb: Feedback, student, topo: Topology, model_args, wrong: list) -> int:
    """Compare shard() with every tensor of one model on this rank; append (text, why-args) of each wrong one
    to `wrong`. Returns how many tensors were compared."""
    _, H, H_kv, _, _ = model_args
    cfg, T = _config(*model_args), topo.tp.size
    model = GPT(cfg, topo, dtype=numpy.float64, seed=SEED)
    table, shapes = pieces(cfg), hf_shapes(cfg)
    for p in model.parameters():
        piece = table[p.name]
        shape = shapes[piece.tensor]
        part = piece.tensor.split(".")[-2]
        held = _held(p, piece, shape)
        said, ok = fb.attempt(f"shard({piece.tensor!r}, {shape}, {H}, {H_kv}, {T}, {fb.rank})", student.shard,
                              piece.tensor, shape, H, H_kv, T, fb.rank)
        if not ok:
            return -1
        try:
            said = _normal(said, shape)
        except ValueError as e:
            fb.problem(f"shard({piece.tensor!r}, ...) {e}")
            return -1
        if _box(said, shape) != _box(held, shape):
            text = (f"{piece.tensor} {shape} at H = {H}, H_kv = {H_kv}: you said "
                    f"{_text(part, said, shape, H, H_kv)}, this rank holds {_text(part, held, shape, H, H_kv)}")
            wrong.append((text, (part, said, held, shape, H, H_kv, T)))
    return len(shapes)


def hf_split(student, comm, path=None) -> bool:
    """Exercise 7: shard() of the student's file against the real llama models' shards at T = world size."""
    T = comm.Get_size()
    needs_ranks(7, T)
    if T > MAX_RANKS:
        raise UserError(f"exercise 7's smallest model has H = {MAX_RANKS} query heads: use at most "
                        f"{MAX_RANKS} ranks, not {T}")
    topo = Topology.create(comm)
    fb = Feedback(topo.tp.rank, path)
    wrong, compared = [], 0
    for model_args in MODELS:
        n = _check_model(fb, student, topo, model_args, wrong)
        if not all_true(n >= 0, comm):          # every rank stops at the same model, or none does
            break
        compared += n
    if wrong:
        text, why = wrong[0]
        names = list(dict.fromkeys(w[1][0] for w in wrong))            # in the model's order
        fb.problem(text + (f" (the first of {len(wrong)} wrong answers on this rank: {', '.join(names)})"
                           if len(wrong) > 1 else ""))
        _why(fb, *why)
    if fb.rank == 0:
        fb.facts.append(f"{compared} tensors of {len(MODELS)} llama models: every rank's rows and columns are "
                        "those import-hf reads")
        for _, H, H_kv, _, _ in MODELS:
            lay = head_layout(H, H_kv, T)
            fb.facts.append(f"H = {H}, H_kv = {H_kv}: " + "; ".join(lay.describe(r) for r in range(T)))
    topo.free()
    return finish(comm, 7, "the slices of a Hugging Face folder at T ranks", fb, [
        ("mpi_tp/checkpoint/hf/names.py lists every tensor and its transposition; mpi_tp/model/heads.py's "
         "docstring draws the heads of each rank, H_kv < T included (read it once you have tried)"),
        "docs/course.md, lesson 13; docs/llama.md, 'Grouped-query attention under tensor parallelism'"],
        against="against the shards of the real llama models")
