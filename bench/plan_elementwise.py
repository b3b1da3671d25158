#!/usr/bin/env python3
"""How fast a Transformer block's non-matmul work runs on this machine, in the planner's terms
(fsdp::plan, src/plan/transformer_spec.cpp): one forward and backward of the block of
fsdp::models::Transformer (the same LibTorch operations, from Python), timed whole and with its
matmuls alone; the difference is the elementwise work (norms, softmax, GELU, masking, copies,
residuals), reported per byte the planner counts for it (3 passes of saved_bytes x 2 + 4 c P).
bench/plan_constants.py runs it with the thread settings it measures (OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS in the environment) and writes the results into configs/plan_constants.json.

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$FSDP_PYTHON" bench/plan_elementwise.py --dtype bf16

Prints one JSON object: block_s, matmul_s (the best of the repetitions), planned_bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def best_of(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    # small's block and micro-batch (configs/small.yaml)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    torch.manual_seed(0)
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    B, T, D, H = a.batch, a.seq, a.dim, a.heads
    F, hd = 4 * D, D // H
    lin = lambda i, o, bias: torch.nn.Linear(i, o, bias=bias).to(dtype)
    norm1, norm2 = torch.nn.LayerNorm(D).to(dtype), torch.nn.LayerNorm(D).to(dtype)
    wq, wk, wv, wo = (lin(D, D, False) for _ in range(4))
    w1, w2 = lin(D, F, True), lin(F, D, True)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)

    def block(x):  # src/models/transformer/transformer.cpp, TransformerBlockImpl::forward
        heads = lambda t: t.view(B, T, H, hd).transpose(1, 2)
        y = norm1(x)
        q, k, v = heads(wq(y)), heads(wk(y)), heads(wv(y))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        probs = torch.softmax(scores.masked_fill(future, -math.inf), -1)
        h = x + wo(torch.matmul(probs, v).transpose(1, 2).contiguous().view(B, T, D))
        return h + w2(torch.nn.functional.gelu(w1(norm2(h))))

    x = torch.randn(B, T, D, dtype=dtype, requires_grad=True)
    grad = torch.ones(B, T, D, dtype=dtype)

    def whole():
        block(x).backward(grad)

    # The same matmuls alone: each Linear's forward (x W^T) and its backward's two products
    # (dy W, dy^T x), and the attention's two batched products forward and backward.
    x_d, x_f = torch.randn(B * T, D, dtype=dtype), torch.randn(B * T, F, dtype=dtype)
    w_dd, w_fd, w_df = torch.randn(D, D, dtype=dtype), torch.randn(F, D, dtype=dtype), torch.randn(D, F, dtype=dtype)
    q_, k_ = torch.randn(B * H, T, hd, dtype=dtype), torch.randn(B * H, T, hd, dtype=dtype)
    p_ = torch.randn(B * H, T, T, dtype=dtype)

    def linear(x, w, dy):
        torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x)

    def matmuls():
        with torch.no_grad():
            for _ in range(4):  # wq, wk, wv, wo
                linear(x_d, w_dd, x_d)
            linear(x_d, w_fd, x_f)  # w1
            linear(x_f, w_df, x_d)  # w2
            torch.bmm(q_, k_.transpose(1, 2)), torch.bmm(p_, k_), torch.bmm(p_.transpose(1, 2), q_)  # scores
            torch.bmm(p_, k_), torch.bmm(q_, k_.transpose(1, 2)), torch.bmm(p_.transpose(1, 2), q_)  # p v

    block_s = best_of(whole, a.reps)
    matmul_s = best_of(matmuls, a.reps)
    c = 4 if a.dtype == "fp32" else 2
    N = B * T
    P = B * H * T * T
    saved = c * (16 * N * D + P) + T * T + 2 * 2 * N * 4
    planned = 3 * (2 * saved + c * 4 * P)
    print(json.dumps({"dtype": a.dtype, "threads": torch.get_num_threads(), "block_s": block_s, "matmul_s": matmul_s,
                      "planned_bytes": planned}))


if __name__ == "__main__":
    main()
