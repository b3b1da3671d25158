// progress_board.h — lets a rank whose collective timed out name the ranks that never
// arrived, and the ranks whose process stopped making progress.
//
// Each rank records, per group, the sequence number of the last collective it entered. A
// background thread publishes changed values to the store every few milliseconds, off the
// collectives' critical path (a store round trip per collective would cost more than a small
// all-gather). On a timeout, the diagnosing rank reads every member's value: a member whose
// last entered sequence number is below the failed one never arrived.
//
// The same thread also bumps a per-rank heartbeat counter every kHeartbeat. A rank that
// entered the collective and then stopped (SIGSTOP, a debugger, a frozen machine) looks as if
// it arrived; its heartbeat is what tells it apart from a rank that is merely waiting too.
//
// Every store request is bounded (bounded_store.h): on a host cut off from the store's host, the
// board's requests fail after the store's timeout instead of hanging, so a diagnosis still ends
// (saying the store is unreachable) and the rank still reports its timeout and exits.
#pragma once

#include "src/comm/bounded_store.h"

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace c10d {
class Store;
}

namespace fsdp {
namespace comm {

class ProgressBoard {
 public:
  // `store` should be a connection of its own: the publishing thread must not queue behind a
  // long blocking wait of another thread on a shared connection. Each request gives up after
  // the store's timeout; `where` names the store in that error.
  ProgressBoard(c10::intrusive_ptr<c10d::Store> store, int global_rank, const std::string& where = "the job's store");
  ~ProgressBoard();
  ProgressBoard(const ProgressBoard&) = delete;
  ProgressBoard& operator=(const ProgressBoard&) = delete;

  // Marks this rank as leaving the job (destroy_process_group, or the board's destruction), so
  // that the others' diagnoses do not name its silence a stop. Blocks on the store; never throws.
  void leave();

  // Records that this rank entered collective `seq` of `group`. Cheap; never blocks on I/O.
  void entered(const std::string& group, int64_t seq);

  // The last sequence number each of `global_ranks` entered in `group` (-1: none yet).
  // Publishes this rank's own value first and waits a few publishing periods so that the
  // others' values are current. Blocks on the store; throws if the store is unreachable or a
  // value there is not a sequence number (the diagnosing group reports either in its error).
  std::vector<int64_t> last_entered(const std::string& group, const std::vector<int>& global_ranks);

  // The ranks among `global_ranks` (other than this one) whose heartbeat did not move over a
  // few heartbeat periods. Blocks for about 4 * kHeartbeat; throws if the store is unreachable.
  std::vector<int> stalled(const std::vector<int>& global_ranks);

  // What became of a rank whose heartbeat stopped. Each rank leaves its process's identity on
  // the board when it starts and a mark when it leaves the job: a rank that left, or whose
  // process is gone, is not blamed as stopped. Only on this rank's machine (the same kernel
  // and pid namespace) can a process be looked at; elsewhere it is kSilent. Blocks on the store.
  enum class Fate { kLeft, kGone, kStopped, kSilent };
  Fate fate(int global_rank);

  // How a rank named its host when it joined: the host name, and the address of the interface
  // the transports use when one is named (FSDP_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME), since
  // containers and network namespaces may share a host name. "" when the rank left none.
  // Blocks on the store.
  std::string host_of(int global_rank);
  // This rank's own label, as host_of() gives it to the others.
  static std::string this_host();

  static constexpr std::chrono::milliseconds kPeriod{20};
  static constexpr std::chrono::milliseconds kHeartbeat{250};

 private:
  void publish_loop();
  void publish_dirty();
  void beat();
  void introduce();
  std::string key(const std::string& group, int rank) const;
  std::vector<int64_t> heartbeats(const std::vector<int>& global_ranks);

  BoundedStore store_;
  const int rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  struct Entry {
    int64_t seq = -1;
    bool dirty = false;
  };
  std::map<std::string, Entry> entries_;
  std::mutex store_mu_;  // one store operation at a time from this object
  std::thread thread_;
};

// "[0, 2, 3]": ranks as errors print them.
std::string format_ranks(const std::vector<int>& ranks);

// The part of a timeout error that names, for collective `seq` of `group`, the members that
// never entered it and those whose process stopped making progress, from `board`; starts with
// "; ". Every backend's timeout error uses it. Never throws: a store that cannot be asked is
// reported in the text.
std::string describe_absent_and_stalled(ProgressBoard& board, const std::string& group,
                                        const std::vector<int>& global_ranks, int64_t seq);

}  // namespace comm
}  // namespace fsdp
