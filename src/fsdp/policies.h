// policies.h — what fully_shard's policies mean at run time: the mixed-precision policy's checks,
// the dtypes it gives a group and its casts of forward inputs and outputs; the CPU offload
// policy's checks and the devices it gives a group.
#pragma once

#include "src/fsdp/common.h"
#include "src/fsdp/mesh_info.h"

#include <fsdp/device_mesh.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/offload.h>
#include <fsdp/quantized_comm.h>

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace fsdp {
namespace detail {

// Throws, naming the field, when a dtype of `policy` is not floating point, or when its
// param_dtype needs kernels the mesh's device lacks (fp16 matmul on CPU, in a LibTorch built
// without it).
void check_mp_policy(const MixedPrecisionPolicy& policy, const DeviceMesh& mesh);

// The dtypes of a group whose parameters have dtype `orig`, as FSDP2 resolves them: a
// param_dtype equal to `orig`, or any cast of integer/bool parameters, is no cast; an unset
// reduce_dtype, or one equal to the requested param_dtype, reduces in the gradients' dtype.
GroupDtypes resolve_group_dtypes(const MixedPrecisionPolicy& policy, at::ScalarType orig);

// Throws, naming the option, when a QuantizedComm is out of range, or when quantized_gradients
// is given without a replicate dim to quantize (a 1-D mesh).
void check_quantized_comm(const std::optional<QuantizedComm>& weights, const std::optional<QuantizedComm>& gradients,
                          const MeshInfo& mesh_info);

// Throws when `policy` asks for what this build cannot do (pinned memory without CUDA).
void check_offload_policy(const std::optional<CPUOffloadPolicy>& policy, const DeviceMesh& mesh);

// The devices of a group on `mesh`: the shards on the host under CPU offload, else on the mesh's
// device, which computes either way.
GroupDevices resolve_group_devices(const DeviceMesh& mesh, const std::optional<CPUOffloadPolicy>& policy);

// Replaces every defined floating-point tensor of `tensors` by its cast to `dtype` (an autograd
// op, so gradients flow back in the original dtype). Integer and bool tensors are left alone.
void cast_floating_tensors(std::vector<at::Tensor>& tensors, at::ScalarType dtype);

// The root's forward inputs on an accelerator mesh, as FSDP2 moves them: every defined tensor
// of `tensors` not on `device` is replaced by its copy there (an autograd op, so a gradient flows
// back to the original). The copy blocks the host as FSDP2's .to(device) does, so the caller may
// refill a pinned input buffer as soon as forward returns. Nothing moves on a CPU `device`, as
// in FSDP2, whose inputs move only to an accelerator.
void move_inputs_to_device(std::vector<at::Tensor>& tensors, c10::Device device);

}  // namespace detail
}  // namespace fsdp
