// replicate_sync.cpp — broadcasting a module's values over an HSDP mesh's replicate dim.
#include <fsdp/replicate_sync.h>

#include "src/fsdp/mesh_info.h"

#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>
#include <vector>

namespace fsdp {
namespace {

// The tensors to broadcast, in module order (the same on every rank), each once.
std::vector<at::Tensor> local_values(torch::nn::Module& module, const DeviceMesh& mesh) {
  std::vector<at::Tensor> out;
  for (const auto& item : module.named_parameters()) {
    const at::Tensor& p = item.value();
    if (is_sharded_parameter(p)) {
      TORCH_CHECK(as_dtensor(p).device_mesh() == mesh, "fsdp::sync_module_states: parameter '", item.key(),
                  "' is sharded over another mesh (", as_dtensor(p).device_mesh().str(), ") than ", mesh.str(),
                  "; pass the mesh given to fully_shard");
    }
    out.push_back(p);
  }
  for (const auto& item : module.named_buffers()) out.push_back(item.value());
  return out;
}

// One broadcast of every tensor of one dtype: packed, sent, unpacked in place.
void broadcast_coalesced(const std::vector<at::Tensor>& tensors, ProcessGroup& group) {
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) flat.push_back(t.detach().reshape({-1}));
  at::Tensor packed = at::cat(flat);
  if (packed.numel() == 0) return;
  group.broadcast(packed, /*root=*/0)->wait();
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    t.detach().copy_(packed.narrow(0, offset, n).view(t.sizes()));
    offset += n;
  }
}

}  // namespace

void sync_module_states(torch::nn::Module& module, const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.valid() && mesh.ndim() == 2,
              "fsdp::sync_module_states: needs the 2-D HSDP mesh (replicate, "
              "shard), got ",
              mesh.valid() ? mesh.str() : std::string("an empty mesh"),
              "; on a 1-D FSDP mesh every "
              "rank holds a different shard and there is nothing to copy");
  const detail::MeshInfo info = detail::mesh_info_of(mesh);
  std::shared_ptr<ProcessGroup> replicas = info.replicate_group();
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& t : local_values(module, mesh)) by_dtype[t.scalar_type()].push_back(t);
  at::NoGradGuard no_grad;
  if (replicas->size() == 1) return;
  for (const auto& kv : by_dtype) broadcast_coalesced(kv.second, *replicas);
}

}  // namespace fsdp
