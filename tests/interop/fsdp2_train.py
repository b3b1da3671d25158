#!/usr/bin/env python3
"""The reference side of the differential tests: PyTorch's own FSDP2 training what fsdp-train trains.

Reads the same YAML configuration (and the same `--section.key=value` overrides) as
fsdp-train and trains the same model from the same starting weights on the same global batches,
with PyTorch's `fully_shard` (or DDP for NO_SHARD, `parallelize_module` + `fully_shard` for
tensor parallelism), on CPU with gloo. Writes what the comparison needs into --out:

    result.json   {"losses": [...], "grad_norms": [...], "world": W, ...}: the global-batch mean
                  loss and the gradient norm before clipping of every step (rank 0)
    params.pt     the final full parameters, {fqn: tensor} (torch.save, rank 0)

    $FSDP_PYTHON tests/interop/fsdp2_train.py CONFIG.yaml --world 2 --out DIR [--key=value ...]

The configuration is read strictly: a key this program does not model is refused by name,
never ignored, unless it cannot change the numbers (logging, checkpoint cadence, timeouts).
What each fsdp-train setting becomes here:

    sharding_strategy FULL_SHARD      fully_shard(block, reshard_after_forward=True) per block,
                                      fully_shard(root) (FSDP2's default: the root keeps its
                                      parameters gathered)
    SHARD_GRAD_OP                     the same with reshard_after_forward=False everywhere
    HYBRID_SHARD(_ZERO2)              the same over a 2-D mesh (replicate_degree, W / replicate_degree)
    NO_SHARD                          DistributedDataParallel
    reshard_after_forward: k          the blocks get reshard_after_forward=k
    mixed_precision/param/reduce_dtype  MixedPrecisionPolicy(param_dtype, reduce_dtype) on every call
    activation_checkpointing          torch.utils.checkpoint around every block (reentrant)
    model_parallel_size: k            parallelize_module per block: wq, wk, wv, w1 ColwiseParallel,
                                      wo, w2 RowwiseParallel; with vocab_parallel the embedding
                                      RowwiseParallel and the head ColwiseParallel with the loss
                                      under loss_parallel(); then fully_shard over dp
    model.freeze: [prefixes]          requires_grad=False on the parameters under those names
    model.dtype: float64              model.to(torch.float64) after fully_shard, before training (the
                                      key is tests/interop/to_dtype_driver's: fsdp-train has none)
    gradient_accumulation_steps       set_requires_gradient_sync(last micro-batch) (HSDP:
                                      set_requires_all_reduce; DDP: no_sync())
    max_grad_norm                     torch.nn.utils.clip_grad_norm_
    optimizer / schedule              torch.optim.AdamW, LR set every step by fsdp-train's formula

--resume-dcp DIR and --save-dcp DIR load and save a PyTorch Distributed Checkpoint with the keys
`model`, `optimizer` (get_state_dict's) and `train_state.step`: what fsdp-train's
`checkpoint_format: dcp` reads and writes. --plant NAME changes the reference on purpose (see
PLANTS): the differential test uses it to show that each row can fail.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import socket
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_PEER = os.path.join(_HERE, "..", "..", "bench", "peer")
sys.path.insert(0, os.path.abspath(_PEER))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402

from model import Transformer, make_args  # noqa: E402

# Keys whose values this program reproduces.
MODELLED = {
    "fsdp_config": {"sharding_strategy", "replicate_degree", "reshard_after_forward", "mixed_precision",
                    "param_dtype", "reduce_dtype", "activation_checkpointing", "activation_checkpointing_every",
                    "model_parallel_size", "vocab_parallel", "use_reentrant", "device", "fp16",
                    "shard_optimizer_state", "offload_params", "offload_optimizer_state", "output_head_group"},
    "model": {"preset", "n_layers", "vocab_size", "max_seq_len", "dim", "n_heads", "dropout_p", "init_from",
              "freeze", "dtype"},
    "data": {"source", "data_seed"},
    "optimizer": {"lr", "betas", "beta1", "beta2", "weight_decay", "eps", "fused"},
    "schedule": {"warmup_steps", "min_lr", "decay_steps"},
    "training": {"steps", "micro_batch_size", "gradient_accumulation_steps", "seq_len", "loss_chunks",
                 "max_grad_norm", "seed"},
}
# Keys that cannot change the computed numbers: accepted and not used.
NO_EFFECT = {
    "fsdp_config": {"world_size", "local_rank", "checkpoint_interval", "checkpoint_dir", "checkpoint_format",
                    "collective_timeout_s", "backend", "prefetch_depth",
                    "reduce_scatter_max_input_buffers"},
    "training": {"resume", "export", "allow_resume_mismatch", "keep_checkpoints"},
    "logging": None,  # every key
    "sample": None,
}
# Deliberate errors in the reference, one per kind of row (the differential test shows each row
# fails with one of them).
PLANTS = {
    "divide-factor": "gradients reduced with a divide factor of world + 1 instead of the mean",
    "skip-all-reduce": "HSDP: the replicas never all-reduce their gradients",
    "fp32-compute": "mixed precision: the parameters compute in float32 instead of param_dtype",
    "accumulation-undivided": "gradient accumulation: the micro-batch losses not divided by their number",
    "train-frozen": "model.freeze ignored: the frozen parameters train too",
    "keep-float32": "model.dtype ignored: the model trains in float32",
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class ConfigError(Exception):
    pass


def load_config(path: str, overrides: list[str]) -> dict:
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"{arg}: expected --section.key=value")
        key, value = arg[2:].split("=", 1)
        section, name = key.split(".", 1)
        cfg.setdefault(section, {})[name] = yaml.safe_load(value) if value != "" else ""
    for section, values in cfg.items():
        if section not in MODELLED and section not in NO_EFFECT:
            raise ConfigError(f"{path}: section '{section}' is not modelled by fsdp2_train.py")
        for name in values or {}:
            if name in MODELLED.get(section, ()):
                continue
            if section in NO_EFFECT and (NO_EFFECT[section] is None or name in NO_EFFECT[section]):
                continue
            raise ConfigError(f"{path}: {section}.{name} is not modelled by fsdp2_train.py; the comparison "
                              "would not be of the same run")
    return cfg


def get(cfg: dict, section: str, name: str, default=None):
    value = (cfg.get(section) or {}).get(name, default)
    if value is None:
        raise ConfigError(f"{section}.{name} is missing: fsdp2_train.py needs it written in the config")
    return value


class Run:
    """What one rank needs of the configuration."""

    def __init__(self, cfg: dict, world: int, rank: int, plant: str | None):
        self.cfg, self.world, self.rank, self.plant = cfg, world, rank, plant
        self.strategy = get(cfg, "fsdp_config", "sharding_strategy")
        self.tp = int(get(cfg, "fsdp_config", "model_parallel_size", 1))
        self.vocab_parallel = bool(get(cfg, "fsdp_config", "vocab_parallel", True))
        # Unset (null): one replica per node for HSDP, i.e. 1 on this one machine.
        self.replicate_degree = (cfg.get("fsdp_config") or {}).get("replicate_degree") or 1
        self.reshard_after_forward = (cfg.get("fsdp_config") or {}).get("reshard_after_forward")
        self.accumulation = int(get(cfg, "training", "gradient_accumulation_steps"))
        self.batch = int(get(cfg, "training", "micro_batch_size"))
        self.seq = int(get(cfg, "training", "seq_len"))
        self.steps = int(get(cfg, "training", "steps"))
        self.dp_world = world // self.tp
        self.dp_rank = rank // self.tp  # (dp, tp) mesh, row-major
        self.check_supported()

    def check_supported(self):
        cfg = self.cfg
        for section, name, wanted in (("fsdp_config", "device", "cpu"), ("fsdp_config", "fp16", False),
                                      ("fsdp_config", "offload_params", False),
                                      ("fsdp_config", "output_head_group", False),
                                      ("fsdp_config", "use_reentrant", True), ("training", "loss_chunks", 1),
                                      ("model", "dropout_p", 0.0), ("data", "source", "synthetic")):
            value = (cfg.get(section) or {}).get(name, wanted)
            if value != wanted:
                raise ConfigError(f"{section}.{name}: {value!r} is not modelled by fsdp2_train.py (only {wanted!r})")

    def lr_at(self, step: int) -> float:
        """fsdp-train's schedule: linear warm-up, then cosine decay to min_lr."""
        lr = float(get(self.cfg, "optimizer", "lr"))
        min_lr = float(get(self.cfg, "schedule", "min_lr"))
        warmup = int(get(self.cfg, "schedule", "warmup_steps"))
        decay = int(get(self.cfg, "schedule", "decay_steps"))
        decay = decay if decay > 0 else self.steps - warmup
        if step <= warmup:
            return lr * step / warmup
        t = min(1.0, (step - warmup - 1) / max(decay, 1))
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))

    def mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        param = (self.cfg.get("fsdp_config") or {}).get("param_dtype")
        reduce = (self.cfg.get("fsdp_config") or {}).get("reduce_dtype")
        on = bool(get(self.cfg, "fsdp_config", "mixed_precision", False))
        param_dtype = DTYPES[param] if param else (torch.bfloat16 if on else None)
        reduce_dtype = DTYPES[reduce] if reduce else (torch.float32 if on and param is None else None)
        if param_dtype == torch.float32 or self.plant == "fp32-compute":
            param_dtype = None
        if param_dtype is None and reduce_dtype is None:
            return None
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def build_model(run: Run) -> torch.nn.Module:
    cfg = run.cfg
    fields = {k: v for k, v in (cfg.get("model") or {}).items() if k not in ("preset", "init_from", "freeze", "dtype")}
    args = make_args(get(cfg, "model", "preset"), **fields)
    torch.manual_seed(int(get(cfg, "training", "seed")))
    model = Transformer(args)
    init_from = (cfg.get("model") or {}).get("init_from")
    if init_from:
        model.load_state_dict(torch.load(init_from, map_location="cpu", weights_only=True), strict=True)
    frozen = (cfg.get("model") or {}).get("freeze") or []
    if run.plant != "train-frozen":
        for name, p in model.named_parameters():
            if any(name == f or name.startswith(f + ".") for f in frozen):
                p.requires_grad_(False)
    return model


def parallelize(run: Run, model: torch.nn.Module):
    """Shards `model` as fsdp-train's strategy does. Returns (model, mesh, the FSDP root or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if run.strategy == "NO_SHARD":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)
        if run.plant == "divide-factor":
            ddp.register_comm_hook(float(run.world + 1), divided_all_reduce)
        return ddp, None, None
    hybrid = run.strategy.startswith("HYBRID_SHARD")
    reshard = run.strategy in ("FULL_SHARD", "HYBRID_SHARD")
    if run.tp > 1:
        mesh = init_device_mesh("cpu", (run.dp_world, run.tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(run, model, mesh["tp"])
        dp_mesh = mesh["dp"]
    elif hybrid:
        replicas = run.replicate_degree
        mesh = init_device_mesh("cpu", (replicas, run.world // replicas), mesh_dim_names=("replicate", "shard"))
        dp_mesh = mesh
    else:
        mesh = dp_mesh = init_device_mesh("cpu", (run.world,), mesh_dim_names=("dp",))
    kwargs = {"mesh": dp_mesh}
    policy = run.mp_policy()
    if policy is not None:
        kwargs["mp_policy"] = policy
    block_reshard = reshard
    if run.reshard_after_forward:
        block_reshard = int(run.reshard_after_forward)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=block_reshard, **kwargs)
    fully_shard(model, reshard_after_forward=None if reshard else False, **kwargs)
    if run.plant == "divide-factor":
        # Summed collectives and FSDP2's own pre/post division: gloo has no PREMUL_SUM.
        model.set_force_sum_reduction_for_comms(True)
        model.set_gradient_divide_factor(float(run.world + 1))
    return model, mesh, model


def divided_all_reduce(factor: float, bucket):
    """A DDP comm hook that sums a bucket and divides it by `factor` (--plant divide-factor)."""
    tensor = bucket.buffer().div_(factor)
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def tensor_parallel(run: Run, model: torch.nn.Module, tp_mesh) -> None:
    """fsdp-train's Megatron plan (fsdp::models::parallelize) with PyTorch's parallel styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
        })
        block.attention.n_heads //= run.tp  # each tp rank computes its whole heads
    if run.vocab_parallel:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        })


def tp_attention_forward(self, x):
    """Attention.forward with the local head count: under tensor parallelism the projections
    return this rank's heads only. The arithmetic is model.py's."""
    bsz, seq_len, _ = x.shape
    q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
    k = self.wk(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
    v = self.wv(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous().view(bsz, seq_len, self.n_heads * self.head_dim)
    return self.resid_dropout(self.wo(out))


def checkpointed_forward(model, every: int):
    """Transformer.forward with torch.utils.checkpoint around every `every`-th block (reentrant,
    fsdp-train's only kind)."""
    from torch.utils.checkpoint import checkpoint

    def forward(tokens):
        _, seq_len = tokens.shape
        pos = torch.arange(seq_len, device=tokens.device)
        h = model.dropout(model.tok_embeddings(tokens) + model.pos_embeddings(pos))
        for i, layer in enumerate(model.layers):
            h = checkpoint(layer, h, use_reentrant=True) if i % every == 0 else layer(h)
        return model.output(model.norm(h)).float()
    return forward


def global_batch(run: Run, step: int) -> torch.Tensor:
    """fsdp-train's synthetic data: step s (from 1) draws its global batch from a generator seeded
    data_seed + s - 1."""
    g = torch.Generator()
    g.manual_seed(int(get(run.cfg, "data", "data_seed")) + step - 1)
    vocab = make_args(get(run.cfg, "model", "preset"),
                      **{k: v for k, v in (run.cfg.get("model") or {}).items()
                         if k in ("n_layers", "vocab_size", "max_seq_len", "dim", "n_heads", "dropout_p")}).vocab_size
    rows = run.dp_world * run.accumulation * run.batch
    return torch.randint(0, vocab, (rows, run.seq + 1), generator=g)


def loss_of(run: Run, forward, inputs, targets):
    logits = forward(inputs)
    if run.tp > 1 and run.vocab_parallel:
        from torch.distributed.tensor.parallel import loss_parallel
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)), loss_parallel
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)), None


def set_sync(run: Run, model, micro: int):
    """Which reductions micro-batch `micro` runs (fsdp-train's set_gradient_sync_for)."""
    last = micro == run.accumulation - 1
    if run.strategy == "NO_SHARD":
        return contextlib.nullcontext() if last else model.no_sync()
    if run.strategy.startswith("HYBRID_SHARD"):
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(last and run.plant != "skip-all-reduce")
    else:
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def grad_norm_and_clip(run: Run, params, max_norm: float) -> float:
    if run.tp > 1:
        # clip_grad_norm_ cannot stack DTensors of different meshes (tp-split and dp-only
        # parameters); the same norm from the full gradients, tiny models only.
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1:
                for p in params:
                    p.grad.mul_(coef)
        return norm
    limit = max_norm if max_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, limit)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def full_params(model) -> dict:
    out = {}
    inner = model.module if hasattr(model, "module") else model
    for name, p in inner.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone().contiguous()
    return out


def dcp_state(model, optimizer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd, "train_state": {"step": torch.tensor(step, dtype=torch.int64)}}


def resume_dcp(model, optimizer, path: str) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    state = dcp_state(model, optimizer, 0)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["train_state"]["step"])


def worker(rank: int, world: int, ns, cfg: dict, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    run = Run(cfg, world, rank, ns.plant)
    if run.tp > 1:
        from model import Attention
        Attention.forward = tp_attention_forward
    model, _, fsdp_root = parallelize(run, build_model(run))
    dtype = (cfg.get("model") or {}).get("dtype")
    if dtype and ns.plant != "keep-float32":
        model.to(DTYPES[dtype])  # after fully_shard: FSDPModule._apply re-lays the shards
    inner = model.module if run.strategy == "NO_SHARD" else model
    if get(cfg, "fsdp_config", "activation_checkpointing", False):
        # Set on the instance, so the root's FSDP hooks still run around it.
        inner.forward = checkpointed_forward(inner, int(get(cfg, "fsdp_config", "activation_checkpointing_every", 1)))
    forward = model
    params = [p for p in model.parameters() if p.requires_grad]
    betas = get(cfg, "optimizer", "betas")
    optimizer = torch.optim.AdamW(params, lr=float(get(cfg, "optimizer", "lr")), betas=tuple(float(b) for b in betas),
                                  eps=float(get(cfg, "optimizer", "eps")),
                                  weight_decay=float(get(cfg, "optimizer", "weight_decay")))
    start = 0
    if ns.resume_dcp:
        start = resume_dcp(model, optimizer, ns.resume_dcp)
    max_norm = float(get(cfg, "training", "max_grad_norm"))
    losses, norms = [], []
    for step in range(start + 1, run.steps + 1):
        lr = run.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = global_batch(run, step)
        local = 0.0
        for micro in range(run.accumulation):
            rows = batch.narrow(0, (run.dp_rank * run.accumulation + micro) * run.batch, run.batch)
            inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            with set_sync(run, model, micro):
                loss, parallel_ctx = loss_of(run, forward, inputs, targets)
                if run.accumulation > 1 and run.plant != "accumulation-undivided":
                    loss = loss / run.accumulation
                if parallel_ctx is not None:
                    with parallel_ctx():
                        loss.backward()
                else:
                    loss.backward()
            local += float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
        norms.append(grad_norm_and_clip(run, params, max_norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if ns.save_dcp:
        import torch.distributed.checkpoint as dcp
        dcp.save(dcp_state(model, optimizer, run.steps), checkpoint_id=ns.save_dcp)
    params_out = full_params(model)
    if rank == 0:
        os.makedirs(ns.out, exist_ok=True)
        torch.save(params_out, os.path.join(ns.out, "params.pt"))
        with open(os.path.join(ns.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "grad_norms": norms, "world": world, "first_step": start + 1,
                       "strategy": run.strategy, "plant": ns.plant, "torch": torch.__version__}, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resume-dcp", default=None)
    p.add_argument("--save-dcp", default=None)
    p.add_argument("--plant", choices=sorted(PLANTS), default=None)
    ns, overrides = p.parse_known_args(argv)
    try:
        cfg = load_config(ns.config, overrides)
        Run(cfg, ns.world, 0, ns.plant)  # configuration errors before any process starts
    except (ConfigError, OSError, yaml.YAMLError) as e:
        print(f"fsdp2_train.py: {e}", file=sys.stderr)
        return 2
    torch.multiprocessing.spawn(worker, args=(ns.world, ns, cfg, free_port()), nprocs=ns.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
