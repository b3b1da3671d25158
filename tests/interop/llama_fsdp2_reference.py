"""The reference side of test_llama.py's and test_gpt2.py's training checks: transformers' model
from a Hugging Face directory under PyTorch's fully_shard (one call per decoder layer, then the
root; GPT-2's blocks are its decoder layers), AdamW on the
same batches as hf_driver's train: each data-parallel rank its consecutive rows of every
global batch. With --tp k > 1, a (dp, tp) mesh: each decoder layer first split over tp by
parallelize_module with the plan of fsdp/models/llama_parallelize.h (q/k/v/gate/up Colwise,
o/down Rowwise; embedding, head and norms whole), then fully_shard over dp. With --ac, each
decoder layer wrapped by checkpoint_wrapper (activation checkpointing per layer, as torchtitan
applies it) before its fully_shard.
Writes <out>/losses-<rank>.json, the peak RSS of the steps as <out>/peak-<rank>.json (VmHWM,
reset before the first step) and the final full parameters as <out>/model.safetensors.

    python llama_fsdp2_reference.py <hf_dir> <batches.safetensors> <lr> <out> --world 2 [--tp 2] [--ac]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2_train import free_port  # the same folder: the port the ranks meet on


def reset_peak_rss() -> None:
    """Starts a new VmHWM (Linux: writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers: a Llama's model.layers, GPT-2's transformer.h."""
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def worker(rank: int, world: int, ns, port: int) -> None:
    from safetensors.torch import load_file, save_file
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(ns.hf_dir, dtype=torch.float32, attn_implementation="eager")
    dp_rank, dp_world, fsdp_kwargs = rank, world, {}
    if ns.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world // ns.tp, ns.tp), mesh_dim_names=("dp", "tp"))
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for layer in decoder_layers(model):
            parallelize_module(layer, mesh["tp"], plan)
        dp_rank, dp_world, fsdp_kwargs = mesh["dp"].get_local_rank(), world // ns.tp, {"mesh": mesh["dp"]}
    if ns.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, layer in enumerate(decoder_layers(model)):
            decoder_layers(model)[i] = checkpoint_wrapper(layer)
    for layer in decoder_layers(model):
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ns.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    batches = load_file(ns.batches)["batches"]
    rows = batches.size(1) // dp_world
    losses = []
    reset_peak_rss()
    for step in range(batches.size(0)):
        mine = batches[step].narrow(0, dp_rank * rows, rows)
        inputs, targets = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        # No KV cache in training: a checkpointed layer's recompute would append its keys and
        # values to the cache a second time.
        logits = model(input_ids=inputs, use_cache=False).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    full = {}
    for name, p in model.state_dict().items():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        full[name] = value.detach().clone().contiguous()
    if model.config.tie_word_embeddings:
        full.pop("lm_head.weight", None)
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, f"losses-{rank}.json"), "w") as f:
        json.dump(losses, f)
    with open(os.path.join(ns.out, f"peak-{rank}.json"), "w") as f:
        json.dump({"peak_rss_bytes": peak_rss_bytes()}, f)
    if rank == 0:
        save_file(full, os.path.join(ns.out, "model.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir")
    p.add_argument("batches")
    p.add_argument("lr", type=float)
    p.add_argument("out")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ac", action="store_true", help="checkpoint_wrapper around each decoder layer")
    ns = p.parse_args()
    torch.multiprocessing.spawn(worker, args=(ns.world, ns, free_port()), nprocs=ns.world, join=True)


if __name__ == "__main__":
    main()
