// The NCCL backend's settings as plain values (nccl_settings.h).
#include "src/comm/nccl_settings.h"

#include <cstdlib>

namespace fsdp {
namespace comm {

ReduceOp nccl_reduce_op(ReduceOp op, int group_size) {
  return op == ReduceOp::kAvg && group_size == 1 ? ReduceOp::kSum : op;
}

const std::vector<EnvDefault>& nccl_env_defaults() {
  static const std::vector<EnvDefault> defaults = {{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"}};
  return defaults;
}

void apply_nccl_env_defaults() {
  for (const EnvDefault& d : nccl_env_defaults()) setenv(d.name, d.value, /*overwrite=*/0);
}

NcclGroupIdentity nccl_group_identity(const std::string& name, const std::vector<int>& global_ranks) {
  NcclGroupIdentity id;
  id.group_name = name;
  id.group_desc = "fsdp group " + name;
  id.global_ranks_in_group.assign(global_ranks.begin(), global_ranks.end());
  return id;
}

std::string nccl_init_remedy(const std::string& error) {
  if (error.find("Duplicate GPU") != std::string::npos) {
    return "NCCL needs a GPU of its own for each rank of a group: run one rank per GPU, or set "
           "FSDP_CUDA_BACKEND=gloo to run a \"cuda\" mesh's groups on Gloo through host memory";
  }
  return "every member of the group must create it, in the same order as its other groups (init_device_mesh "
         "and new_group on every rank), within the timeout (fsdp::InitOptions().timeout(...) or "
         "FSDP_COLLECTIVE_TIMEOUT_MS)";
}

}  // namespace comm
}  // namespace fsdp
