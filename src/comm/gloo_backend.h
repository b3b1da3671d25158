// gloo_backend.h — the CPU implementation of fsdp::ProcessGroup on Gloo's TCP transport, through
// c10d's ProcessGroupGloo of the same LibTorch (so the process holds one gloo: the one inside
// libtorch_cpu).
//
// Every collective of a group runs on that group's one communication thread, in issue order
// (QueuedProcessGroup); this is where data moves, and the only place that waits on the
// transport. The algorithms are ours (p2p_algorithms.h: c10d's Gloo reduce-scatters by an
// all-reduce and a copy, and all-gathers through a staging copy): they run on ProcessGroupGloo's
// point-to-point send and recv of byte ranges.
#pragma once

#include "src/comm/p2p_algorithms.h"
#include "src/comm/queued_process_group.h"

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Store;
class Backend;
}  // namespace c10d

namespace fsdp {
namespace comm {

class ProgressBoard;

struct GlooGroupConfig {
  int rank = 0;                   // this process's rank in the group
  std::vector<int> global_ranks;  // members, in group-rank order
  std::string name;               // unique per program; scopes the store keys
  std::chrono::milliseconds timeout{300000};
  c10::intrusive_ptr<c10d::Store> store;  // used to exchange transport addresses
  std::string transport_host;             // address to bind, or empty when `transport_iface` is set
  std::string transport_iface;            // network interface to bind (GLOO_SOCKET_IFNAME)
  std::shared_ptr<ProgressBoard> board;   // for naming absent ranks on a timeout; may be null
};

class GlooProcessGroup final : public QueuedProcessGroup {
 public:
  // Connects to every other member through the store (collective over the members; blocks
  // until all have connected or the timeout expires) and starts the communication thread.
  explicit GlooProcessGroup(GlooGroupConfig config);
  ~GlooProcessGroup() override;

 private:
  void wait_until_every_member_connected();
  void execute(const Op& op, int64_t seq) override;
  [[noreturn]] void fail(const Op& op, int64_t seq, const std::string& cause);
  std::string diagnose_absent_and_stalled(int64_t seq);

  // The algorithms. Each returns when its data has fully arrived (or throws).
  void all_gather(const Op& op, int64_t seq);
  void reduce_scatter(const Op& op, int64_t seq);
  void all_reduce(const Op& op, int64_t seq);
  void broadcast(const Op& op, int64_t seq);
  void barrier(int64_t seq);

  class GlooTransfers;  // posts byte-range sends/receives and waits on them (gloo_backend.cpp)
  // The algorithms' view of this group for operation `seq`; its transfers count bytes as `kind`.
  Transport transport(CollectiveKind kind, int64_t seq);

  GlooGroupConfig config_;
  c10::intrusive_ptr<c10d::Backend> peers_;         // c10d's ProcessGroupGloo; null for a group of one
  std::chrono::steady_clock::time_point deadline_;  // of the operation being executed
};

}  // namespace comm
}  // namespace fsdp
