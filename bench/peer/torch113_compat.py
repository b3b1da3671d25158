"""In-process compatibility shims for Debian's python3-torch 1.13.1 on Python 3.11,
CPU only, gloo backend. Nothing on disk is modified.

1. ``install_metadata_import_hook()`` -- a meta-path finder for
   ``torch.distributed._shard.sharded_tensor.metadata``. Debian's file has::

       tensor_properties: TensorProperties = field(default=TensorProperties())

   which Python >= 3.11 rejects at class-creation time ("ValueError: mutable
   default ... use default_factory"), so ``import torch.distributed.fsdp``
   fails. The hook reads the module's source, rewrites that one expression to
   ``field(default_factory=TensorProperties)`` and executes the result as the
   module (bypassing any stale __pycache__). If the source is already fixed the
   hook executes it unchanged. Must be installed before the module is first
   imported (``import torch`` alone does not import it).

2. ``patch_fsdp_for_cpu_gloo()`` -- FSDP in torch 1.13 refuses CPU-only runs
   (``_lazy_init`` raises "FSDP does not support CPU only execution", the
   compute device is hard-coded to ``cuda:<current>``, CUDA streams/events are
   created unconditionally) and gloo in 1.13 implements neither
   ``_all_gather_base`` nor ``_reduce_scatter_base``. This function, only when
   CUDA is unavailable, makes FSDP's own code run on CPU:

   * inside the three FSDP modules (fully_sharded_data_parallel, flat_param,
     algorithms._comm_hooks.default_hooks) the module-global ``torch`` is
     replaced by a proxy whose ``torch.cuda`` provides no-op Stream/Event/stream
     context objects (CPU kernels and blocking gloo collectives already complete
     in program order, so stream synchronisation has nothing to do), and the
     module-global ``dist`` by a proxy whose ``_all_gather_base`` is gloo
     ``all_gather`` into views of the flat output tensor and whose
     ``_reduce_scatter_base`` (SUM) is gloo ``all_to_all_single`` followed by a
     local sum of the W received chunks (same bytes on the wire per rank as a
     reduce-scatter: (W-1)/W of the input); gloo 1.13 has no bfloat16, so a
     bfloat16 all-gather (FSDP1 ``MixedPrecision(param_dtype=torch.bfloat16)``)
     moves its bytes as uint8 views, which is exact (reductions stay in the
     reduce_dtype, float32 here, which gloo supports);
   * ``FullyShardedDataParallel._get_compute_device`` returns ``cpu`` for a
     module whose parameters are on CPU;
   * ``Tensor.record_stream`` ignores the shim's stream objects (all other calls
     go to the original).

   Everything else -- FlatParameter flattening/sharding, padding, the
   pre/post-forward and pre/post-backward hooks, resharding, backward prefetch,
   gradient pre/post-division -- is the unmodified torch 1.13 FSDP code.
   Only the training path (forward/backward/optimizer step) is exercised;
   state_dict / optim-state / clip_grad_norm_ helpers still contain hard CUDA
   calls and are not supported under this shim.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types
from typing import Optional

METADATA_MODULE = "torch.distributed._shard.sharded_tensor.metadata"
_BUGGY_DEFAULT = re.compile(r"field\(\s*default\s*=\s*TensorProperties\s*\(\s*\)\s*\)")
_FIXED_DEFAULT = "field(default_factory=TensorProperties)"


# --------------------------------------------------------------------------
# 1. import hook for sharded_tensor/metadata.py
# --------------------------------------------------------------------------

class _PatchedSourceLoader(importlib.abc.Loader):
    def __init__(self, finder: "MetadataFixFinder", origin: str, source_path: str):
        self.finder = finder
        self.origin = origin            # reported as module.__file__
        self.source_path = source_path  # where the text is read from

    def create_module(self, spec):
        return None  # default module creation

    def get_source(self, fullname: str) -> str:
        with open(self.source_path, "r", encoding="utf-8") as fh:
            src = fh.read()
        fixed, n = _BUGGY_DEFAULT.subn(_FIXED_DEFAULT, src)
        self.finder.status = "fixed" if n else "already-fixed"
        self.finder.replacements = n
        return fixed

    def exec_module(self, module) -> None:
        src = self.get_source(module.__name__)
        code = compile(src, self.origin, "exec", dont_inherit=True)
        exec(code, module.__dict__)


class MetadataFixFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that serves ``torch.distributed._shard.sharded_tensor.metadata``
    from its (textually fixed) source. ``source_path`` overrides where the text
    is read from (used by the self-test to feed it Debian's original file)."""

    def __init__(self, source_path: Optional[str] = None):
        self.source_path = source_path
        self.status = "not-imported"   # -> "fixed" | "already-fixed"
        self.replacements = 0
        self.origin: Optional[str] = None

    def find_spec(self, fullname, path, target=None):
        if fullname != METADATA_MODULE:
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None or not real.origin or not real.origin.endswith(".py"):
            return None  # let the normal machinery report / handle it
        self.origin = real.origin
        loader = _PatchedSourceLoader(self, real.origin, self.source_path or real.origin)
        return importlib.util.spec_from_file_location(fullname, real.origin, loader=loader)


_installed_finder: Optional[MetadataFixFinder] = None


def install_metadata_import_hook(source_path: Optional[str] = None) -> MetadataFixFinder:
    """Installs the finder at the front of sys.meta_path (idempotent)."""
    global _installed_finder
    if _installed_finder is None:
        _installed_finder = MetadataFixFinder(source_path)
        sys.meta_path.insert(0, _installed_finder)
        if METADATA_MODULE in sys.modules:
            _installed_finder.status = "imported-before-hook"
    elif source_path is not None:
        _installed_finder.source_path = source_path
    return _installed_finder


def metadata_hook_status() -> str:
    return _installed_finder.status if _installed_finder is not None else "not-installed"


# --------------------------------------------------------------------------
# 2. FSDP (torch 1.13) on CPU + gloo
# --------------------------------------------------------------------------

class _CpuStream:
    """Stand-in for torch.cuda.Stream: CPU work is already ordered."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    """Stand-in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _CpuStream()


def _no_cuda_device(*args, **kwargs):
    raise RuntimeError("torch113_compat: FSDP asked for a CUDA device on a CPU-only run "
                       "(unsupported FSDP API under the CPU shim)")


def _make_cuda_shim() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        is_available=lambda: True,  # only FSDP's own guards see this
        Stream=_CpuStream,
        Event=_CpuEvent,
        stream=lambda stream=None: contextlib.nullcontext(),
        current_stream=lambda device=None: _CURRENT_STREAM,
        synchronize=lambda device=None: None,
        current_device=_no_cuda_device,
        set_device=_no_cuda_device,
        device_count=lambda: 0,
    )


class _ModuleProxy(types.ModuleType):
    """Module object that serves selected attributes itself and delegates the
    rest to a real module."""

    def __init__(self, real: types.ModuleType, **overrides):
        super().__init__(real.__name__, real.__doc__)
        self.__dict__["_real_module"] = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self.__dict__["_real_module"], name)


def _make_dist_proxy(dist):
    ReduceOp = dist.ReduceOp

    def _uses_gloo(group) -> bool:
        return dist.get_backend(group) == "gloo"

    def _all_gather_base(output_tensor, input_tensor, group=None, async_op=False):
        if not _uses_gloo(group):
            return dist._all_gather_base(output_tensor, input_tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("torch113_compat: async _all_gather_base on gloo")
        world = dist.get_world_size(group)
        if output_tensor.numel() != world * input_tensor.numel() or not output_tensor.is_contiguous():
            raise ValueError("torch113_compat: _all_gather_base expects a contiguous output "
                             "with world_size * input.numel() elements")
        flat_out, flat_in = output_tensor.view(world, -1), input_tensor.contiguous().view(-1)
        if flat_in.dtype == torch_mod().bfloat16:
            # gloo in 1.13 has no bfloat16 ("Invalid scalar type"); an all-gather only moves
            # bytes, so move them as uint8 (exact; used by MixedPrecision(param_dtype=bfloat16))
            flat_out, flat_in = flat_out.view(torch_mod().uint8), flat_in.view(torch_mod().uint8)
        outs = list(flat_out.unbind(0))  # views into output_tensor
        dist.all_gather(outs, flat_in, group=group)
        return None

    def _reduce_scatter_base(output, input, op=ReduceOp.SUM, group=None, async_op=False):
        if not _uses_gloo(group):
            return dist._reduce_scatter_base(output, input, op=op, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("torch113_compat: async _reduce_scatter_base on gloo")
        if op != ReduceOp.SUM:
            raise NotImplementedError(f"torch113_compat: _reduce_scatter_base op {op} on gloo")
        world = dist.get_world_size(group)
        if input.numel() != world * output.numel():
            raise ValueError("torch113_compat: _reduce_scatter_base expects input.numel() == "
                             "world_size * output.numel()")
        send = input.contiguous().view(-1)
        recv = torch_mod().empty_like(send)
        # chunk j of `send` goes to rank j; chunk j of `recv` is rank j's chunk for me
        dist.all_to_all_single(recv, send, group=group)
        output.copy_(recv.view(world, -1).sum(dim=0).view_as(output))
        return None

    return _ModuleProxy(dist, _all_gather_base=_all_gather_base,
                        _reduce_scatter_base=_reduce_scatter_base)


def torch_mod():
    import torch
    return torch


_fsdp_patched = False


def patch_fsdp_for_cpu_gloo() -> str:
    """Applies the FSDP CPU/gloo shim (idempotent). Returns a status string."""
    global _fsdp_patched
    import torch
    if torch.cuda.is_available():
        return "not-needed-cuda-available"
    if _fsdp_patched:
        return "applied"
    import torch.distributed as dist
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_mod
    import torch.distributed.fsdp.flat_param as flat_param_mod
    import torch.distributed.algorithms._comm_hooks.default_hooks as hooks_mod

    torch_proxy = _ModuleProxy(torch, cuda=_make_cuda_shim())
    dist_proxy = _make_dist_proxy(dist)
    for mod in (fsdp_mod, flat_param_mod, hooks_mod):
        if getattr(mod, "torch", None) is not torch or getattr(mod, "dist", None) is not dist:
            raise RuntimeError(f"torch113_compat: unexpected globals in {mod.__name__}; "
                               "this shim targets torch 1.13.x")
        mod.torch = torch_proxy
        mod.dist = dist_proxy

    FSDP = fsdp_mod.FullyShardedDataParallel
    orig_get_compute_device = FSDP._get_compute_device

    def _get_compute_device(self, module, ignored_params, device_from_device_id):
        param = next(self._get_orig_params(module, ignored_params), None)
        on_cpu = param is None or param.device.type == "cpu"
        if on_cpu and (device_from_device_id is None or device_from_device_id.type == "cpu"):
            return torch.device("cpu")
        return orig_get_compute_device(self, module, ignored_params, device_from_device_id)

    FSDP._get_compute_device = _get_compute_device

    orig_record_stream = torch.Tensor.record_stream

    def record_stream(self, stream):
        if isinstance(stream, _CpuStream):
            return None
        return orig_record_stream(self, stream)

    torch.Tensor.record_stream = record_stream
    _fsdp_patched = True
    return "applied"
