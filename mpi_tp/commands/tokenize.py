"""`mpi-tp tokenize`: a corpus tokenized once into a token file that training memory-maps.

    mpi-tp tokenize --data shakespeare --tokenizer path/to/tokenizer.json --out data/shakespeare.bin
    mpi-tp tokenize --data pydoc --train-bpe 2048 --out data/pydoc          # data/pydoc/tokenizer.json + tokens.bin
    mpiexec -n 2 mpi-tp train --data data/pydoc/tokens.bin                   # the vocabulary from the file

One process does the work (under mpiexec, rank 0; the others wait for its status). The token file
(mpi_tp.text.token_file) records which tokenizer made it, so the end-of-run sample is decoded with
it; the same ids come out as tokenizing in memory (tests/test_tokenize.py).
"""
from __future__ import annotations

import os
import time

from mpi_tp.core.errors import UserError, refuse_to_replace


def cmd_tokenize(args, comm) -> int:
    from mpi_tp.commands.common import on_rank0
    return on_rank0(lambda: _tokenize(args), comm)


def _tokenize(args) -> int:
    from mpi_tp.text.bpe import train_bpe
    from mpi_tp.text.token_file import write_tokens
    from mpi_tp.text.tokenizer import load_tokenizer
    from mpi_tp.training.data import load_corpus
    if (args.tokenizer is None) == (args.train_bpe is None):
        raise UserError("give --tokenizer (bytes, a tokenizer.json, or a folder holding one) or --train-bpe V")
    corpus = load_corpus(args.data)
    if corpus.tokenizer is not None:
        raise UserError(f"--data {args.data} is a token file already: give the text it came from")
    text = corpus.data.tobytes().decode("utf-8", errors="replace")
    t0 = time.perf_counter()
    if args.train_bpe is not None:
        refuse_to_replace(args.out, args.overwrite, "tokenize --out")
        tok_path, out = os.path.join(args.out, "tokenizer.json"), os.path.join(args.out, "tokens.bin")
        train_bpe(text, args.train_bpe, tok_path)
        print(f"trained a byte-level BPE of {args.train_bpe} tokens on {corpus.name} in "
              f"{time.perf_counter() - t0:.1f} s: {tok_path}", flush=True)
        tok, overwrite = load_tokenizer(tok_path), True
    else:
        tok, out, overwrite = load_tokenizer(args.tokenizer), args.out, args.overwrite
    ids = tok.encode(text)
    meta = write_tokens(out, ids, tok, {"name": corpus.name, "source": corpus.source, "sha256": corpus.sha256,
                                        "bytes": int(corpus.data.size)}, overwrite=overwrite)
    print(f"{out}: {meta['count']:,} tokens ({meta['dtype']}, vocabulary {meta['vocab_size']:,}) from "
          f"{corpus.data.size:,} bytes, {corpus.data.size / max(meta['count'], 1):.2f} bytes per token, in "
          f"{time.perf_counter() - t0:.1f} s; train on it with --data {out}", flush=True)
    return 0


def add_parser(sub) -> None:
    t = sub.add_parser("tokenize", help="tokenize a corpus once into a token file (for --data FILE.bin)",
                       description="Tokenize a corpus into a flat token file (uint16 or uint32, with a JSON "
                                   "sidecar) that `mpi-tp train --data FILE.bin` memory-maps: with a "
                                   "tokenizer.json (a Hugging Face model's), or a byte-level BPE trained on "
                                   "the corpus here (--train-bpe V).")
    t.add_argument("--data", default="pydoc", help="'pydoc', 'shakespeare' or a text file (default pydoc)")
    t.add_argument("--tokenizer", help="'bytes', a tokenizer.json, or a folder holding one")
    t.add_argument("--train-bpe", type=int, metavar="V", help="train a byte-level BPE of V tokens (257 or more) "
                                                              "on the corpus; --out is then a folder")
    t.add_argument("--out", required=True, help="the token file (.bin), or with --train-bpe a folder for "
                                                "tokenizer.json and tokens.bin")
    t.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    t.set_defaults(run=cmd_tokenize)
