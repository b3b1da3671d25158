#!/usr/bin/env python3
"""Pre-tokenization with a Hugging Face `tokenizers` tokenizer (tokenizer.json: the byte-level
BPE of Llama 3 and Qwen) into fsdp-train's token file format, for data.path and eval.path:

    python tools/pretokenize.py --tokenizer tokenizer.json input.txt output.tokens

fsdp-train reads SentencePiece models itself (`fsdp-train tokenize --tokenizer m.model`); a
tokenizer.json needs the Rust BPE of the `tokenizers` PyPI package, which
scripts/install-deps.sh installs into the project's venv (scripts/torch-env.sh says where).
The file records the tokenizer's vocabulary size (get_vocab_size(with_added_tokens=True)), so
fsdp-train checks it against model.vocab_size. Only the text is encoded: no BOS/EOS is added
(add_special_tokens=False), as `fsdp-train tokenize` adds none.

The format (tools/fsdp-train/data/data.h), little-endian: "FSDPTOK\\0", uint32 version 1, uint32 bytes
per token (2 when the vocabulary fits uint16, else 4), uint64 vocabulary size, uint64 count N,
then N ids.
"""

import argparse
import os
import struct
import sys


def write_token_file(path, ids, vocab_size):
    width = 2 if vocab_size <= 65536 else 4
    import array

    body = array.array("H" if width == 2 else "I", ids)
    if sys.byteorder != "little":
        body.byteswap()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(b"FSDPTOK\0" + struct.pack("<IIQQ", 1, width, vocab_size, len(ids)))
        f.write(body.tobytes())
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    p.add_argument("input", help="the text to tokenize (UTF-8)")
    p.add_argument("output", help="the token file to write")
    a = p.parse_args(argv)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("pretokenize: the `tokenizers` package is missing: run scripts/install-deps.sh and use the "
                 "venv's Python (scripts/torch-env.sh), or pip install tokenizers")

    try:
        tok = Tokenizer.from_file(a.tokenizer)
    except Exception as e:  # the Rust side raises its own exception types
        sys.exit(f"pretokenize: {a.tokenizer} (--tokenizer): not a tokenizers tokenizer.json: {e}")
    with open(a.input, encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text, add_special_tokens=False).ids
    vocab = tok.get_vocab_size(with_added_tokens=True)
    write_token_file(a.output, ids, vocab)
    print(f"pretokenize: {len(ids)} tokens (vocabulary {vocab}) from {a.input} -> {a.output}")


if __name__ == "__main__":
    main()
