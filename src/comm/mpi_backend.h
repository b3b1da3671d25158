// mpi_backend.h — fsdp::ProcessGroup on MPI: the MPI library's own collectives (shared memory
// within a node, the fastest interconnect across nodes, tuned algorithms), for jobs started by
// mpirun or srun. Built only when CMake found MPI (FSDP_WITH_MPI).
//
// Design: as in the Gloo backend, each group has one communication thread that runs the
// group's collectives in issue order (QueuedProcessGroup), here as MPI calls on the group's own
// communicator: MPI's blocking collectives, and for large reductions our ring
// (p2p_algorithms.h) on MPI's point-to-point messages. Callers overlap compute with them and
// wait on the Work. Several groups' threads call MPI at once, so MPI runs at
// MPI_THREAD_MULTIPLE.
//
// MPI has no timeouts and cannot cancel a collective. A process-wide watchdog keeps
// fsdp-cpp's promise instead: when an operation outlives the group's timeout it prints the
// error (op, sequence number, group, and from the progress board the ranks that never
// arrived) and ends the whole job with MPI_Abort, since no rank could leave the stuck call.
#pragma once

#include "src/comm/p2p_algorithms.h"
#include "src/comm/queued_process_group.h"

#include <mpi.h>

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

class ProgressBoard;

// The MPI job as this process sees it.
struct MpiJob {
  int rank = 0;
  int size = 1;
};

// Initialises MPI at MPI_THREAD_MULTIPLE on first use (or checks the level of an MPI the
// program initialised itself) and returns this process's place in MPI_COMM_WORLD. MPI is
// finalised at exit (only when fsdp-cpp initialised it); `before_finalize` runs first, to tear
// down the groups. Throws c10::Error when MPI cannot give MPI_THREAD_MULTIPLE.
MpiJob mpi_job(void (*before_finalize)());

// A store for the progress board, hosted by world rank 0 on a free port and reached by the
// others at the address rank 0 broadcasts over MPI (loopback when the whole job is on one
// node). Collective over MPI_COMM_WORLD. `server` keeps rank 0's server alive; `client` is a
// connection of its own for the board.
struct MpiBoardStore {
  c10::intrusive_ptr<c10d::Store> server;
  c10::intrusive_ptr<c10d::Store> client;
};
MpiBoardStore mpi_board_store(std::chrono::milliseconds timeout);

struct MpiGroupConfig {
  std::vector<int> global_ranks;  // members, in group-rank order
  std::string name;               // unique per program
  std::chrono::milliseconds timeout{300000};
  std::shared_ptr<ProgressBoard> board;  // for naming absent ranks on a timeout; may be null
};

class MpiProcessGroup final : public QueuedProcessGroup {
 public:
  // The world group (all ranks) on a duplicate of MPI_COMM_WORLD. Collective over the world.
  static std::shared_ptr<MpiProcessGroup> world(MpiGroupConfig config);
  // A sub-group of the world: collective over its MEMBERS only (MPI_Comm_create_group), bounded
  // by the timeout like a collective. `instance` tells repeated groups of one member set apart.
  static std::shared_ptr<MpiProcessGroup> subgroup(MpiGroupConfig config, int instance);
  ~MpiProcessGroup() override;

 protected:
  // Refuses, on the caller's thread, what MPI cannot do (dtypes it cannot reduce, counts past int).
  WorkHandle enqueue(Op op) override;

 private:
  MpiProcessGroup(MpiGroupConfig config, MPI_Comm comm);
  void execute(const Op& op, int64_t seq) override;
  void run_under_watchdog(const Op& op, int64_t seq);
  std::string timeout_message(CollectiveKind kind, int64_t seq);

  // Large reduce-scatters and all-reduces run our ring on MPI's point-to-point messages.
  bool runs_point_to_point(int64_t total_bytes) const;
  Transport transport();
  // MPI_Allgather(v) of pieces of `counts` elements of `type` into `out`.
  void all_gather_pieces(const void* send, char* out, const std::vector<int64_t>& counts, MPI_Datatype type);

  void all_gather(const Op& op);
  void reduce_scatter(const Op& op);
  void all_reduce(const Op& op);
  void broadcast(const Op& op);

  MpiGroupConfig config_;
  MPI_Comm comm_;  // this group's own communicator; collectives only from the communication thread
};

}  // namespace comm
}  // namespace fsdp
