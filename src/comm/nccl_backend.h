// nccl_backend.h — fsdp::ProcessGroup on NCCL, through c10d's ProcessGroupNCCL of the same
// LibTorch (the engine PyTorch's own FSDP2 uses on GPUs). Built with -DFSDP_USE_CUDA=ON only,
// into libfsdp_cuda: nccl_backend.cpp sets nccl_group_factory() when that library is loaded (with
// libfsdp), and without it asking for the backend fails saying how to build it.
//
// Creating a group is collective over its members: it binds the group to this rank's GPU and
// makes its communicator (throws CollectiveError with the remedy when NCCL refuses, e.g. two
// ranks on one GPU). Where data moves: NCCL's kernels on c10d's communication stream, which
// waits for the stream current when the collective is issued. Who waits: the caller, through
// Work::wait(), which makes its current stream wait (the host does not block). Timeouts and the
// record of recent collectives are c10d's: its watchdog and its flight recorder
// (TORCH_NCCL_TRACE_BUFFER_SIZE), under the group's name and its members' world ranks. Once the
// watchdog found a collective of the group timed out or failed, every later collective of the
// group fails at its wait() with a CollectiveError (nccl_settings.h says why the process lives).
#pragma once

#include <fsdp/process_group.h>

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
}

namespace fsdp {
namespace comm {

struct NcclGroupConfig {
  int rank = 0;                   // this process's rank in the group
  std::vector<int> global_ranks;  // members, in group-rank order
  std::string name;               // unique per program; scopes the store keys
  std::chrono::milliseconds timeout{300000};
  c10::intrusive_ptr<c10d::Store> store;         // for NCCL's unique id; a prefix of the group's own
  c10::Device device{c10::DeviceType::CUDA, 0};  // this rank's GPU
};

using NcclGroupFactory = std::shared_ptr<ProcessGroup> (*)(NcclGroupConfig);
// The NCCL backend's constructor, or null in a build without the CUDA path.
NcclGroupFactory& nccl_group_factory();

}  // namespace comm
}  // namespace fsdp
