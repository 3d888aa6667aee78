"""Train a byte-level BPE tokenizer on a corpus (GPT-2's kind: every byte representable, merges learned
from the text), with the `tokenizers` library, and write it as a tokenizer.json.

    mpi-tp tokenize --data pydoc --train-bpe 1024 --out tok/     # tok/tokenizer.json, tok/tokens.bin
"""
from __future__ import annotations

import os

from mpi_tp.text.tokenizer import TokenizerError

CHUNK = 1 << 20          # the corpus reaches the trainer in pieces of about this many characters


def train_bpe(text: str, vocab_size: int, path: str) -> None:
    """Learn vocab_size - 1 tokens (the 256 bytes first, then merges) and an end-of-text token from
    `text`; write the tokenizer to `path` (a tokenizer.json)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise TokenizerError("--train-bpe needs the 'tokenizers' library: pip install tokenizers") from None
    if not 257 <= vocab_size <= 1 << 20:
        raise TokenizerError(f"--train-bpe {vocab_size}: the vocabulary must hold the 256 bytes and an "
                             "end-of-text token, and at most 2^20 tokens: give 257 to 1048576")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((text[i:i + CHUNK] for i in range(0, len(text), CHUNK)), trainer=trainer,
                            length=len(text))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tok.save(path)
