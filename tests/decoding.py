"""What the decoding tests share (tests/test_decode.py for GPT-2, tests/test_llama_decode.py for Llama): the
reference logits of a full forward pass, and a driver of rows that join, step and leave a Decoder."""
import numpy

from mpi_tp.inference.decode import Decoder, window


def full_last(model, row) -> numpy.ndarray:
    """The reference: the whole context (its last block_size tokens) through the model, the last position's
    logits (V,)."""
    return model.full_logits(numpy.array([row[-model.cfg.block_size:]]))[0, -1]


def join_step_leave(model, serial, plan: dict, leaving: dict, steps: int, rng, slots: int = 3):
    """Drive a Decoder of `slots` rows over `steps` steps: at step s the rows leaving[s] leave first (the last
    rows take their slots), every running row is given a random next token and steps, then the prompts
    plan[s] join. After every step each row's logits are compared with serial's full forward pass of its
    window (mpi_tp.inference.decode.window). Returns (decoder, rows: each row's tokens, the worst difference)."""
    S, V = model.cfg.block_size, model.cfg.vocab_size
    dec, rows, worst = Decoder(model, slots), [], 0.0
    logits = numpy.zeros((0, V))
    for step in range(steps):
        if step in leaving:
            order = dec.leave(leaving[step])
            rows, logits = [rows[i] for i in order], logits[order]
        nxt = rng.integers(0, V, len(rows))
        for r, i in zip(rows, nxt):
            r.append(int(i))
        logits = dec.step(nxt) if rows else logits
        new = plan.get(step, [])
        logits = numpy.concatenate([logits, dec.join(new)]) if new else logits
        rows += [list(p) for p in new]
        for b, r in enumerate(rows):
            worst = max(worst, float(numpy.abs(logits[b] - full_last(serial, r[-window(len(r), S):])).max()))
    return dec, rows, worst
