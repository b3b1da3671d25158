"""The eval loss of `fsdp-train eval`, computed directly with PyTorch, for the end-to-end test.

bench/peer/model.py's Transformer (the same model as fsdp-train's) is loaded from fsdp-train's
export (a torch.save state dict) and run over the windows `fsdp-train eval` reads: `windows`
consecutive, non-overlapping windows of seq + 1 tokens from the start of the token file, every
predicted token weighted alike. Prints the mean cross-entropy.

usage: eval_reference.py PEER_DIR MODEL.pt TOKENS N_LAYERS DIM N_HEADS VOCAB MAX_SEQ_LEN SEQ WINDOWS
"""

import struct
import sys

import torch
import torch.nn.functional as F


def read_tokens(path):
    """The ids of a token file of fsdp-train's format (data.h): magic, version, bytes per
    token, vocabulary size, count, then little-endian ids."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"FSDPTOK\0", path
    _version, width, _vocab, count = struct.unpack_from("<IIQQ", data, 8)
    dtype = {2: "<u2", 4: "<u4"}[width]
    import numpy as np

    return torch.from_numpy(np.frombuffer(data, dtype=dtype, count=count, offset=32).astype("int64"))


def main():
    peer_dir, model_path, tokens_path = sys.argv[1:4]
    n_layers, dim, n_heads, vocab, max_seq_len, seq, windows = map(int, sys.argv[4:11])
    sys.path.insert(0, peer_dir)
    from model import Transformer, make_args

    args = make_args("tiny", n_layers=n_layers, dim=dim, n_heads=n_heads, vocab_size=vocab,
                     max_seq_len=max_seq_len, dropout_p=0.0)
    model = Transformer(args)
    model.load_state_dict(torch.load(model_path))
    model.eval()
    rows = read_tokens(tokens_path)[: windows * (seq + 1)].view(windows, seq + 1)
    with torch.no_grad():
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab).double(), rows[:, 1:].reshape(-1))
    print(f"reference eval loss: {loss.item():.10g}")


if __name__ == "__main__":
    main()
