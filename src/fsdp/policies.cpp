// policies.cpp — the mixed-precision policy: its printed form, its checks, the dtypes it resolves
// to for a group, and the casts at module boundaries; the CPU offload policy's checks and devices.
#include "src/fsdp/policies.h"

#include "src/device/device_ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <sstream>
#include <string>

namespace fsdp {

namespace {

std::string dtype_name(const std::optional<at::ScalarType>& dtype) {
  return dtype ? std::string(c10::toString(*dtype)) : std::string("None");
}

}  // namespace

std::string MixedPrecisionPolicy::str() const {
  std::ostringstream s;
  s << "MixedPrecisionPolicy(param_dtype=" << dtype_name(param_dtype())
    << ", reduce_dtype=" << dtype_name(reduce_dtype()) << ", output_dtype=" << dtype_name(output_dtype())
    << ", cast_forward_inputs=" << (cast_forward_inputs() ? "true" : "false") << ")";
  return s.str();
}

namespace detail {
namespace {

void check_floating(const std::optional<at::ScalarType>& dtype, const char* field) {
  TORCH_CHECK(!dtype || at::isFloatingType(*dtype), "fully_shard: MixedPrecisionPolicy.", field,
              " must be a "
              "floating-point dtype (torch::kFloat32, torch::kBFloat16, torch::kFloat16), got ",
              *dtype);
}

// Whether this LibTorch has an fp16 matmul on CPU, and if not, what it said. Probed once: the
// answer depends on the LibTorch build (2.x's have one), not on the input.
const std::string& cpu_half_matmul_error() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    try {
      at::mm(at::ones({2, 2}, at::kHalf), at::ones({2, 2}, at::kHalf));
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
      if (error.empty()) error = "fp16 matmul failed";
    }
  });
  return error;
}

}  // namespace

void check_mp_policy(const MixedPrecisionPolicy& policy, const DeviceMesh& mesh) {
  check_floating(policy.param_dtype(), "param_dtype");
  check_floating(policy.reduce_dtype(), "reduce_dtype");
  check_floating(policy.output_dtype(), "output_dtype");
  if (policy.param_dtype() == at::kHalf && mesh.device_type() == "cpu") {
    const std::string& error = cpu_half_matmul_error();
    TORCH_CHECK(error.empty(),
                "fully_shard: MixedPrecisionPolicy.param_dtype = Half (fp16) on a CPU mesh "
                "needs fp16 matmul on CPU, which this LibTorch does not have (it says: ",
                error,
                "). Use "
                "torch::kBFloat16 as param_dtype instead (same range as fp32, no gradient scaler needed).");
  }
}

GroupDtypes resolve_group_dtypes(const MixedPrecisionPolicy& policy, at::ScalarType orig) {
  GroupDtypes d{orig, orig, orig};
  if (!at::isFloatingType(orig)) return d;  // integer and bool parameters are never cast
  const auto& param = policy.param_dtype();
  if (param) d.unsharded = *param;
  const auto& reduce = policy.reduce_dtype();
  d.reduce = (reduce && reduce != param) ? *reduce : d.unsharded;
  return d;
}

void check_offload_policy(const std::optional<CPUOffloadPolicy>& policy, const DeviceMesh& mesh) {
  TORCH_CHECK(!policy || !policy->pin_memory() || device::ops_for(mesh.device()).can_pin_host_memory(),
              "fully_shard: ", policy->str(),
              " needs pinned host memory, which pins host memory for a device's copies, and the mesh ", "is on ",
              mesh.device().str(), "; pass fsdp::CPUOffloadPolicy().pin_memory(false) on a \"cpu\" mesh");
}

void check_quantized_comm(const std::optional<QuantizedComm>& weights, const std::optional<QuantizedComm>& gradients,
                          const MeshInfo& mesh_info) {
  if (weights) weights->check("fully_shard: quantized_weights");
  TORCH_CHECK(!weights || !weights->skip_zero_blocks(),
              "fully_shard: quantized_weights with skip_zero_blocks: only gradients skip zero blocks (weights "
              "are all-gathered whole); turn skip_zero_blocks off for quantized_weights");
  if (!gradients) return;
  gradients->check("fully_shard: quantized_gradients");
  TORCH_CHECK(mesh_info.is_hsdp(),
              "fully_shard: quantized_gradients quantizes HSDP's all-reduce over the replicate "
              "mesh dim, but the mesh ",
              mesh_info.mesh.str(),
              " has none; pass a 2-D (replicate, shard) mesh, or "
              "halve the reduce-scatter's bytes with MixedPrecisionPolicy().reduce_dtype(at::kBFloat16) instead");
  TORCH_CHECK(!gradients->skip_zero_blocks() || mesh_info.mesh.device_type() == "cpu",
              "fully_shard: quantized_gradients with skip_zero_blocks is not supported yet on a ",
              mesh_info.mesh.device_type(), " mesh (its block counts are read on the host); turn skip_zero_blocks off");
}

GroupDevices resolve_group_devices(const DeviceMesh& mesh, const std::optional<CPUOffloadPolicy>& policy) {
  const c10::Device compute = mesh.device();
  const c10::Device shard = policy ? c10::Device(c10::kCPU) : compute;
  return GroupDevices{compute, shard, policy && policy->pin_memory(), policy.has_value()};
}

void cast_floating_tensors(std::vector<at::Tensor>& tensors, at::ScalarType dtype) {
  for (auto& t : tensors) {
    if (t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != dtype) t = t.to(dtype);
  }
}

void move_inputs_to_device(std::vector<at::Tensor>& tensors, c10::Device device) {
  if (device.is_cpu()) return;
  for (auto& t : tensors) {
    if (t.defined() && t.device() != device) t = t.to(device);
  }
}

}  // namespace detail
}  // namespace fsdp
