"""Text as tokens: the tokenizers (bytes by default, or a Hugging Face tokenizer.json), flat token
files for training (tokenized once, memory-mapped), and byte-level BPE trained on a corpus.

    tokenizer.py    load_tokenizer: ByteTokenizer (V = 256, needs nothing) or a tokenizer.json
    stream.py       ids to text as they come (a generation's stream)
    chat.py         a Hugging Face folder's chat template: messages to a prompt (mpi-tp serve's chat)
    token_file.py   write_tokens / read_tokens: FILE.bin (uint16 or uint32) and FILE.bin.json
    bpe.py          train_bpe: a byte-level BPE tokenizer.json from a corpus
"""
