"""What the decoding tests share (tests/test_decode.py for GPT-2, tests/test_llama_decode.py for Llama): the
reference logits of a full forward pass, a counter of the rows a Decoder prefills, and a driver of rows that
join, step and leave a Decoder."""
import numpy

from mpi_tp.inference.decode import Decoder, window


def full_last(model, row) -> numpy.ndarray:
    """The reference: the whole context (its last block_size tokens) through the model, the last position's
    logits (V,)."""
    return model.full_logits(numpy.array([row[-model.cfg.block_size:]]))[0, -1]


def count_prefills(dec: Decoder) -> list:
    """Count the rows `dec` runs from column 0, call by call (each call appends its number of rows).
    The cache's evidence: a recomputed prefix gives the same logits, but a row is prefilled only when it
    joins or its window starts again (decode.window); every other step reads its prefix from the cache."""
    calls, prefill = [], dec._prefill

    def counted(rows, prompts):
        calls.append(len(prompts))
        return prefill(rows, prompts)
    dec._prefill = counted
    return calls


def restarts(rows, S: int) -> int:
    """How many of these rows (their tokens, the step's new one included) start their window again now."""
    return sum(1 for r in rows if len(r) > S and window(len(r), S) == S // 2)


def join_step_leave(model, serial, plan: dict, leaving: dict, steps: int, rng, slots: int = 3):
    """Drive a Decoder of `slots` rows over `steps` steps: at step s the rows leaving[s] leave first (the last
    rows take their slots), every running row is given a random next token and steps, then the prompts
    plan[s] join. After every step each row's logits are compared with serial's full forward pass of its
    window (mpi_tp.inference.decode.window), and the decoder must have prefilled only the rows that joined or
    whose window started again, its cache holding each row's window. Returns (decoder, rows: each row's tokens,
    the worst difference)."""
    S, V = model.cfg.block_size, model.cfg.vocab_size
    dec, rows, worst = Decoder(model, slots), [], 0.0
    prefilled, want = count_prefills(dec), 0
    logits = numpy.zeros((0, V))
    for step in range(steps):
        if step in leaving:
            order = dec.leave(leaving[step])
            rows, logits = [rows[i] for i in order], logits[order]
        nxt = rng.integers(0, V, len(rows))
        for r, i in zip(rows, nxt):
            r.append(int(i))
        want += restarts(rows, S)
        logits = dec.step(nxt) if rows else logits
        new = plan.get(step, [])
        want += len(new)
        logits = numpy.concatenate([logits, dec.join(new)]) if new else logits
        rows += [list(p) for p in new]
        for b, r in enumerate(rows):
            worst = max(worst, float(numpy.abs(logits[b] - full_last(serial, r[-window(len(r), S):])).max()))
    # (the same on every rank: the plan and the rng decide it, so no rank can fail alone)
    assert sum(prefilled) == want, f"{sum(prefilled)} rows prefilled, want {want}: a prefix was recomputed"
    assert list(dec.cache.lengths[:len(rows)]) == [window(len(r), S) for r in rows]
    return dec, rows, worst
