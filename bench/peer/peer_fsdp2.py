#!/usr/bin/env python3
"""Peer baseline: train model.Transformer with PyTorch's own FSDP2
(torch.distributed.fsdp.fully_shard), DDP or a single process, on CPU with the
gloo backend, using PyTorch 2.15.

Run with the project's Python: $FSDP_PYTHON (scripts/torch-env.sh), by default
~/.cache/fsdp-cpp/venv-torch-2.15.0/bin/python (see README.md). Examples:

    PY=${FSDP_PYTHON:-~/.cache/fsdp-cpp/venv-torch-2.15.0/bin/python}
    $PY peer_fsdp2.py --mode single --preset tiny --batch 8 --steps 10
    $PY peer_fsdp2.py --mode fsdp2 --world 2 --preset small --batch 8 --steps 8
    $PY peer_fsdp2.py --mode fsdp2-grad-op --world 2 --preset tiny --batch 4
    $PY peer_fsdp2.py --mode fsdp2 --world 2 --preset tiny --mixed-precision bf16
    $PY -m torch.distributed.run --standalone --nproc_per_node 2 \\
        peer_fsdp2.py --mode fsdp2 --preset tiny --batch 4 --json-out out.json

Prints one JSON line (rank 0) at the end; see README.md for the fields.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import os
import platform
import re
import resource
import socket
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model import ModelArgs, Transformer, add_model_cli_args, count_params, model_args_from_cli  # noqa: E402

MODES = ("single", "ddp", "fsdp2", "fsdp2-grad-op", "hsdp")
MIXED_PRECISION = ("none", "bf16")
# fully_shard(reshard_after_forward=...) per mode, and the FSDP1 sharding strategy it corresponds to
RESHARD_AFTER_FORWARD = {"fsdp2": True, "fsdp2-grad-op": False, "hsdp": True}
FSDP_STRATEGY = {"fsdp2": "FULL_SHARD", "fsdp2-grad-op": "SHARD_GRAD_OP", "hsdp": "HYBRID_SHARD"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="single",
                   help="single: one process, no process group; ddp: DistributedDataParallel; "
                        "fsdp2: fully_shard(reshard_after_forward=True) (FULL_SHARD); "
                        "fsdp2-grad-op: fully_shard(reshard_after_forward=False) (SHARD_GRAD_OP); "
                        "hsdp: fully_shard on a 2-D (replicate 2, shard world/2) mesh (HYBRID_SHARD)")
    p.add_argument("--world", type=int, default=None,
                   help="number of ranks (default 1; under torchrun, taken from WORLD_SIZE)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (B)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: max_seq_len)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="leading steps excluded from the median")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0, help="model-init seed (same on every rank)")
    p.add_argument("--data-seed", type=int, default=1234,
                   help="global batch of step s is drawn from torch.Generator seeded data_seed + s")
    p.add_argument("--data-path", default=None,
                   help="a token file of fsdp-train's own format (fsdp-train tokenize): each step's rows are "
                        "windows of seq + 1 tokens at offsets drawn as fsdp-train's data.source: tokens draws "
                        "them (randint(0, n - seq) from the generator seeded data_seed + step), so both sides "
                        "train on the same batches; default: uniform random tokens")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores shared by all ranks (threads per rank = max(1, cores // world))")
    p.add_argument("--threads", type=int, default=None, help="override torch intra-op threads per rank")
    p.add_argument("--mixed-precision", choices=MIXED_PRECISION, default="none",
                   help="bf16: FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) -- "
                        "bf16 compute, fp32 gradient reduction and fp32 master weights for the optimizer; "
                        "--mode single does the same by hand with a bf16 working copy of the model "
                        "(see README.md); not for ddp")
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file (rank 0)")
    p.add_argument("--save-init", default=None,
                   help="rank 0 writes the freshly initialised model's state_dict here with torch.save "
                        "(a plain dict FQN -> tensor, before any wrapping), so another implementation can "
                        "start from the same weights")
    p.add_argument("--init-from", default=None,
                   help="load a state_dict saved by torch.save (FQN -> tensor; read with weights_only=True) "
                        "into the model before wrapping")
    p.add_argument("--master-port", type=int, default=None, help="port for the spawn/in-process launcher")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: NCCL, the model and batches on GPU local_rank, and the CUDA caching allocator's "
                        "peak (torch.cuda.max_memory_allocated) in the JSON; steps timed after a synchronize")
    p.add_argument("--hf-model", default=None,
                   help="a Hugging Face directory (config.json and safetensors): train transformers' "
                        "AutoModelForCausalLM from it instead of model.Transformer (the Llama family); "
                        "fully_shard then goes on every decoder layer (model.model.layers) and the root")
    p.add_argument("--hf-config", default=None,
                   help="with --save-init DIR: build transformers' model from this config.json with --seed "
                        "and write it to DIR with save_pretrained (fp32 safetensors), then exit")
    add_model_cli_args(p)  # --preset, --n-layers, --vocab-size, --max-seq-len, --dim, --n-heads, --dropout-p/--dropout
    args = p.parse_args(argv)
    if args.hf_config:
        if not args.save_init:
            p.error("--hf-config writes a starting Hugging Face directory: give it --save-init DIR")
        return args
    if args.hf_model:
        # the directory is the whole model: an option that would shape or load another is refused
        given = [a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")]
        clash = [o for o in given if o in ("--preset", "--init-from") or
                 o.lstrip("-").replace("-", "_") in {f.name for f in dataclasses.fields(ModelArgs)} or o == "--dropout"]
        if clash:
            p.error(f"--hf-model {args.hf_model} is the whole model (config.json and weights); remove {', '.join(clash)}")
        args.preset = None
    # benchmark/parity default: dropout 0 unless --dropout-p is given explicitly
    args.model_args = hf_model_args(args.hf_model) if args.hf_model else model_args_from_cli(args, dropout_default=0.0)
    if args.seq is None:
        args.seq = args.model_args.max_seq_len
    if args.seq > args.model_args.max_seq_len:
        p.error(f"--seq {args.seq} > max_seq_len {args.model_args.max_seq_len}")
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if args.mixed_precision != "none" and args.mode == "ddp":
        p.error("--mixed-precision is for --mode single and the fsdp2 modes")
    return args


def hf_model_args(hf_dir: str) -> argparse.Namespace:
    """The sizes of a Hugging Face directory's config.json that the run and its JSON use, under
    transformers' common names (AutoConfig maps GPT-2's n_embd, n_layer, ... onto them)."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(hf_dir)
    intermediate = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
    return argparse.Namespace(architecture=(c.architectures or ["?"])[0], vocab_size=c.vocab_size,
                              max_seq_len=c.max_position_embeddings, dim=c.hidden_size,
                              n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
                              n_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                              intermediate_size=intermediate,
                              tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)))


def save_hf_init(config_json: str, out_dir: str, seed: int) -> None:
    """transformers' model of a config.json, initialised with `seed`, written with save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_json), dtype=torch.float32)
    model.save_pretrained(out_dir)


def build_model(args) -> torch.nn.Module:
    if args.hf_model:
        # sdpa attention, transformers' default: what a Python user's training script gets
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(args.hf_model, dtype=torch.float32)
    model = Transformer(args.model_args)
    if args.init_from:
        state = torch.load(args.init_from, map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    return model


def logits_of(forward, inputs: torch.Tensor, hf: bool) -> torch.Tensor:
    # use_cache=False: a training step keeps no key/value cache
    return forward(input_ids=inputs, use_cache=False).logits if hf else forward(inputs)


def decoder_layers(model) -> list:
    """The blocks that get a fully_shard each: model.Transformer's layers, or transformers'
    decoder layers (a Llama's model.model.layers, GPT-2's model.transformer.h)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return list(inner.layers)
    gpt2 = getattr(model, "transformer", None)
    return list(gpt2.h) if gpt2 is not None and hasattr(gpt2, "h") else list(model.layers)


def _mib_vmhwm() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB -> MiB
    return float("nan")


def _mib_ru_maxrss() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kB -> MiB


_TOKEN_FILES = {}


def read_token_file(path: str) -> torch.Tensor:
    """fsdp-train's token file (tools/fsdp-train/data.cpp): 'FSDPTOK\0', version, bytes per token,
    vocab size, token count (little-endian), then the tokens; as int64."""
    if path not in _TOKEN_FILES:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:8] != b"FSDPTOK\0":
            raise SystemExit(f"--data-path {path}: not a token file of fsdp-train's format (fsdp-train tokenize)")
        width = int.from_bytes(raw[12:16], "little")
        count = int.from_bytes(raw[24:32], "little")
        dtype = {2: torch.int16, 4: torch.int32}[width]
        ids = torch.frombuffer(bytearray(raw[32:32 + width * count]), dtype=dtype).to(torch.int64)
        _TOKEN_FILES[path] = ids & (0xFFFF if width == 2 else 0xFFFFFFFF)
    return _TOKEN_FILES[path]


def global_batch(step: int, args, world: int) -> torch.Tensor:
    """(world*B, seq+1) int64 tokens for this step; identical on every rank."""
    g = torch.Generator()
    g.manual_seed(args.data_seed + step)
    rows = world * args.batch
    if getattr(args, "data_path", None):
        tokens = read_token_file(args.data_path)
        starts = torch.randint(0, tokens.numel() - args.seq, (rows, 1), generator=g)
        return tokens[(starts + torch.arange(args.seq + 1)).reshape(-1)].reshape(rows, args.seq + 1)
    return torch.randint(0, args.model_args.vocab_size, (rows, args.seq + 1), generator=g)


def local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of a parameter (the local shard of an FSDP2 DTensor parameter)."""
    to_local = getattr(p, "to_local", None)
    return (to_local() if to_local is not None else p).numel()


def wrap_model(model, args, world):
    """Returns (wrapped_model, info dict)."""
    info = {}
    if args.mode == "single":
        return model, info
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model), info
    # FSDP2: one fully_shard per TransformerBlock, then one on the root (which takes the
    # remaining parameters: embeddings, final norm, output head), as in PyTorch's FSDP2 tutorial.
    # FULL_SHARD: the blocks reshard after forward; the root is left at fully_shard's default
    # (reshard_after_forward=None, which FSDP2 resolves to False for the root: backward needs its
    # parameters first), as fsdp-train does. SHARD_GRAD_OP: nothing reshards after forward.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    if args.mode == "hsdp":
        mesh = init_device_mesh(args.device, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp",))
    reshard = RESHARD_AFTER_FORWARD[args.mode]
    kwargs = {"mesh": mesh}
    if args.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root_reshard = None if reshard else False
    for block in decoder_layers(model):
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=root_reshard, **kwargs)
    units = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    info.update(
        api="torch.distributed.fsdp.fully_shard",
        reshard_after_forward={"blocks": reshard, "root": root_reshard},
        sharding_strategy=FSDP_STRATEGY[args.mode],
        # FSDP2 shards over every rank of the mesh, W = 1 included (one shard = the whole tensor).
        effective_sharding_strategy=FSDP_STRATEGY[args.mode],
        mesh=str(mesh),
        wrap=("fully_shard per decoder layer (model.model.layers), then on the root" if args.hf_model
              else "fully_shard per TransformerBlock, then on the root"),
        fsdp_units=units,
        n_fsdp_units=len(units),
        mixed_precision=str(kwargs["mp_policy"]) if "mp_policy" in kwargs else None,
    )
    return model, info


class Bf16WorkingCopy:
    """``--mode single --mixed-precision bf16``: what FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)`` does on one rank, done by hand. The model given keeps the fp32 master
    weights (the optimizer's parameters); a bf16 copy computes. Before every forward the master
    weights are cast into the copy (FSDP2 casts its fp32 shard to bf16 at each all-gather); forward
    and backward run in bf16 (activations, LayerNorm, softmax, GELU included, as under FSDP2's
    param_dtype); after backward the bf16 gradients are cast to fp32 and handed to the master weights
    (FSDP2 casts them to reduce_dtype for the reduce-scatter, which leaves them fp32 for the
    optimizer). Not torch.autocast, which would keep LayerNorm/softmax in fp32 and cast weights per op."""

    def __init__(self, master: torch.nn.Module):
        self.work = copy.deepcopy(master).to(torch.bfloat16)
        self.pairs = list(zip(master.parameters(), self.work.parameters()))

    def __call__(self, *inputs, **kwargs):
        with torch.no_grad():
            for m, w in self.pairs:
                w.copy_(m)
        return self.work(*inputs, **kwargs)

    def grads_to_master(self) -> None:
        for m, w in self.pairs:
            m.grad = None if w.grad is None else w.grad.float()
            w.grad = None


def worker(rank: int, world: int, args, init_method) -> None:
    threads = args.threads or max(1, args.cores // world)
    torch.set_num_threads(threads)
    distributed = args.mode != "single"
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=init_method, rank=rank,
                                world_size=world, timeout=datetime.timedelta(minutes=60))
    margs = args.model_args
    torch.manual_seed(args.seed)  # identical init on every rank
    model = build_model(args)
    if args.save_init and rank == 0:
        # a plain dict of plain, contiguous CPU tensors (FQN -> tensor), taken before any wrapping
        torch.save({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, args.save_init)
    n_params = count_params(model)
    if args.device == "cuda" and args.mode in ("single", "ddp"):
        model.to(device)  # fully_shard moves the fsdp2 modes' parameters itself
    model, info = wrap_model(model, args, world)
    local_numel_total = sum(local_numel(p) for p in model.parameters())
    # Adam with its defaults: on CPU torch picks the single-tensor (for-loop) implementation
    # (neither foreach nor fused), for plain and for DTensor parameters alike; the JSON records it.
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    adam_impl = _adam_impl(opt)
    model.train()
    forward, working_copy = model, None
    mp_impl = None
    if args.mixed_precision == "bf16":
        mp_impl = ("bf16 working copy of the model (params bfloat16, grads cast to float32, fp32 master "
                   "weights)" if args.mode == "single" else "FSDP2 " + str(info.get("mixed_precision")))
    if args.mode == "single" and args.mixed_precision == "bf16":
        working_copy = Bf16WorkingCopy(model)
        forward = working_copy

    step_s, losses = [], []
    lo, hi = rank * args.batch, (rank + 1) * args.batch
    for step in range(args.steps):
        tokens = global_batch(step, args, world)[lo:hi]
        inputs, targets = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
        if args.device == "cuda":
            torch.cuda.synchronize()
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = logits_of(forward, inputs, bool(args.hf_model))
        loss = F.cross_entropy(logits.view(-1, margs.vocab_size), targets.view(-1))
        loss.backward()
        if working_copy is not None:
            working_copy.grads_to_master()
        opt.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.detach().clone())
        if rank == 0 and os.environ.get("PEER_VERBOSE"):
            print(f"[rank0] step {step} loss {loss.item():.6f} {step_s[-1]:.3f}s", file=sys.stderr, flush=True)

    if info:
        info["root_reshards_after_forward"] = _root_reshards_after_forward(model)
    median_s = statistics.median(step_s[args.warmup:])
    loss_t = torch.stack(losses).double()  # on the device: NCCL reduces device tensors
    per_rank = {"median_s": median_s, "vmhwm": _mib_vmhwm(), "ru_maxrss": _mib_ru_maxrss(),
                "local_numel": local_numel_total,
                "cuda_peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if args.device == "cuda" else None}
    if distributed:
        dist.all_reduce(loss_t)  # mean over ranks of per-rank mean loss == global-batch mean loss
        loss_t /= world
        gathered = [None] * world
        dist.all_gather_object(gathered, per_rank)
    else:
        gathered = [per_rank]
    loss_t = loss_t.cpu()

    if rank == 0:
        tokens_per_step = world * args.batch * args.seq
        group = opt.param_groups[0]
        result = {
            "mode": args.mode,
            "world": world,
            "preset": args.preset,
            "hf_model": args.hf_model,
            "model_args": vars(margs),
            "params": n_params,
            "local_param_numel_per_rank": [g["local_numel"] for g in gathered],
            "batch": args.batch,
            "global_batch": world * args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "warmup": args.warmup,
            "median_step_s": median_s,
            "median_step_s_per_rank": [g["median_s"] for g in gathered],
            "tokens_per_s": tokens_per_step / median_s,
            "peak_rss_mib_per_rank": [round(g["vmhwm"], 1) for g in gathered],
            "device": args.device,
            "cuda_peak_allocated_mib_per_rank": [g["cuda_peak_mib"] for g in gathered],
            "ru_maxrss_mib_per_rank": [round(g["ru_maxrss"], 1) for g in gathered],
            "losses": [float(x) for x in loss_t],
            "final_loss": float(loss_t[-1]),
            "step_s_rank0": [round(s, 6) for s in step_s],
            "torch_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "lr": args.lr,
            "seed": args.seed,
            "data_seed": args.data_seed,
            "optimizer": {"name": "Adam", "lr": args.lr, "betas": list(group["betas"]), "eps": group["eps"],
                          "foreach": group.get("foreach"), "fused": group.get("fused"), "impl": adam_impl},
            "launcher": args.launcher,
            "backend": ("nccl" if args.device == "cuda" else "gloo") if distributed else None,
            "mixed_precision": args.mixed_precision,
            "mixed_precision_impl": mp_impl,
            "fsdp": info or None,
            "torch_version": torch.__version__,
            "torch_file": torch.__file__,
            "blas": _blas_info(),
            "python": platform.python_version(),
            "python_executable": sys.executable,
        }
        line = json.dumps(result)
        print(line, flush=True)
        if args.json_out:
            with open(args.json_out, "w") as fh:
                fh.write(line + "\n")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def _root_reshards_after_forward(model) -> bool | None:
    """Whether the root's parameters were resharded after forward, as FSDP2 resolved it at its
    lazy init (None when that private state is not where torch 2.15 keeps it)."""
    try:
        group = model._get_fsdp_state()._fsdp_param_group
        return None if group is None else group.post_forward_mesh_info is not None
    except AttributeError:
        return None


def _adam_impl(opt: torch.optim.Optimizer) -> str:
    """Which Adam implementation torch runs for these parameters: "fused", "foreach" or
    "single-tensor" (what torch.optim resolves foreach=None, fused=None to)."""
    group = opt.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None:
        return "foreach" if group["foreach"] else "single-tensor"
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
        _, foreach = _default_to_fused_or_foreach(list(group["params"]), differentiable=False, use_fused=False)
    except (ImportError, TypeError):
        return "default (unknown)"
    return "foreach" if foreach else "single-tensor"


def _blas_info() -> str | None:
    """BLAS_INFO from torch's build configuration (the wheel links MKL statically, so ldd shows none)."""
    m = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    return m.group(1) if m else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.hf_config:
        save_hf_init(args.hf_config, args.save_init, args.seed)
        return
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is not None and "RANK" in os.environ and args.mode != "single":
        # launched by torch.distributed.run / torchrun: one process per rank
        world, rank = int(env_world), int(os.environ["RANK"])
        if args.world not in (None, world):
            raise SystemExit(f"--world {args.world} disagrees with WORLD_SIZE={world}")
        args.launcher = "torch.distributed.run"
        worker(rank, world, args, "env://")
        return
    world = args.world or 1
    if args.mode == "single":
        if world != 1:
            raise SystemExit("--mode single runs one process; use --world 1")
        args.launcher = "none"
        worker(0, 1, args, None)
        return
    init_method = f"tcp://127.0.0.1:{args.master_port or _free_port()}"
    if world == 1:
        args.launcher = "in-process"
        worker(0, 1, args, init_method)
        return
    import torch.multiprocessing as mp
    args.launcher = "torch.multiprocessing.spawn"
    mp.spawn(worker, args=(world, args, init_method), nprocs=world, join=True)


if __name__ == "__main__":
    main()
