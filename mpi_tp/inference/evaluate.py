"""A model's loss on a text: the mean next-token cross-entropy over windows of block_size + 1 tokens.

    loss, n = evaluate_file(model, tokens)      # nats per token, over n targets (`mpi-tp eval`)

The windows start at 0, S, 2S, ... (S = block_size) and each holds S + 1 tokens, so every token after the
first of a window is a target once; a text shorter than one window is refused (a UserError). Every rank of
the model's group calls it with the same tokens.
"""
from __future__ import annotations

import numpy

from mpi_tp.core.errors import UserError


def eval_windows(tokens: numpy.ndarray, S: int, batch_size: int):
    """Batches (x, y) of the windows starting at 0, S, 2S, ... that hold S + 1 bytes."""
    starts = numpy.arange(0, tokens.size - S, S)       # start + S + 1 <= size
    if starts.size == 0:
        raise UserError(f"the evaluation text has {tokens.size} bytes; one window needs {S + 1} "
                        f"(block_size + 1): use a longer file")
    for i in range(0, starts.size, batch_size):
        idx = starts[i:i + batch_size, None] + numpy.arange(S + 1)[None, :]     # (B, S + 1)
        w = tokens[idx].astype(numpy.int64)
        yield w[:, :-1], w[:, 1:]


def evaluate_file(model, tokens: numpy.ndarray, batch_size: int = 16) -> tuple[float, int]:
    """(mean next-token cross-entropy in nats, number of targets) over the text's windows. model: a GPT
    (mpi_tp.model.gpt), anything with cfg.block_size and forward(x, y) -> the batch's mean loss."""
    total, count = 0.0, 0
    for x, y in eval_windows(tokens, model.cfg.block_size, batch_size):
        total += model.forward(x, y) * y.size          # the loss is a mean over the batch's targets
        count += y.size
    return total / count, count
