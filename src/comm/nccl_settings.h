// nccl_settings.h — what the NCCL backend (nccl_backend.cpp, in the CUDA path) asks of c10d's
// ProcessGroupNCCL, as plain values with no CUDA type, so that every build compiles and tests
// them: the reduce op NCCL runs, the process environment c10d reads when it creates a group, and
// the identity a group is created with.
#pragma once

#include <fsdp/process_group.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace comm {

// The op an NCCL collective over `group_size` ranks runs for `op`. On one rank, AVG is SUM (both
// give the input back), and NCCL's own AVG is not trusted there: FSDP2 warns that it can give
// wrong results at world size 1.
ReduceOp nccl_reduce_op(ReduceOp op, int group_size);

// One environment variable c10d reads when it creates a ProcessGroupNCCL, and fsdp-cpp's value.
struct EnvDefault {
  const char* name;
  const char* value;
};

// TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): when a collective times out, c10d's watchdog
// aborts the group's communicators instead of ending the process (its default, 3, ends it from
// the watchdog's thread, so no error of fsdp-cpp is ever seen). The process lives on, and the
// group's next collective fails with a CollectiveError that names the rank, the op and the group
// (and fsdp::fully_shard's wait adds the module).
const std::vector<EnvDefault>& nccl_env_defaults();

// Sets each of nccl_env_defaults() that the environment does not set already (a value the user
// or the launcher chose is kept). Called once when the CUDA path is loaded, before any group
// exists and, with the CUDA path loaded with libfsdp, before main: setenv is not safe while
// other threads read the environment.
void apply_nccl_env_defaults();

// The name and members a group gives c10d (ProcessGroupNCCL::Options group_name, group_desc and
// global_ranks_in_group), which its flight recorder and its watchdog's messages show: fsdp-cpp's
// own name of the group and its members' world ranks.
struct NcclGroupIdentity {
  std::string group_name;
  std::string group_desc;
  std::vector<uint64_t> global_ranks_in_group;
};
NcclGroupIdentity nccl_group_identity(const std::string& name, const std::vector<int>& global_ranks);

// What to do when making a group's communicator failed with NCCL's message `error`: NCCL refuses
// two ranks of a group on one GPU ("Duplicate GPU detected"); otherwise a member did not join.
std::string nccl_init_remedy(const std::string& error);

}  // namespace comm
}  // namespace fsdp
