// layer: comm (what may include what: docs/architecture.md)
/// \file
/// fsdp/process_group.h — fsdp-cpp's own process-group layer: the collectives FSDP needs,
/// asynchronous, with timeouts and per-group counters.
///
/// FSDP code talks only to this interface, never to c10d, so c10d's version differences and
/// its Gloo gaps (a reduce-scatter that is an all-reduce and a copy, no uneven all-gather into
/// one tensor) stay out of it. The CPU implementations run their own algorithms on the
/// point-to-point send and recv of c10d's ProcessGroupGloo (or on MPI); the CUDA build adds one on
/// c10d's ProcessGroupNCCL (backend "nccl").
///
/// Example (every rank of the group runs the same lines, in the same order):
///
/// \code{.cpp}
///   auto pg = fsdp::world();                       // after fsdp::init_process_group()
///   at::Tensor shard = at::ones({4});
///   at::Tensor full = at::empty({4 * pg->size()});
///   auto work = pg->all_gather_into(full, shard);  // returns at once
///   ...                                            // overlap compute here
///   work->wait();                                  // full is ready; rethrows any error
/// \endcode
///
/// Collective contract, true of every collective method below:
///  - It is collective: every member of the group must call it, with matching sizes and dtype,
///    in the same order relative to the group's other collectives.
///  - It does not block: it queues the operation on the group's communication thread (Gloo,
///    MPI) or on the device's communication stream (NCCL) and returns a Work. The caller must
///    not touch the output (or modify the input) until wait() returns. The Work keeps the
///    tensors alive until the operation is done.
///  - Tensors must be contiguous, all on one device. The CPU backends (gloo, mpi) take CPU
///    tensors, and CUDA tensors too, staged through pinned host memory: the input is copied to
///    the host when the operation is issued, and the output back on the stream that calls
///    wait() (so that W ranks can share one GPU, which NCCL refuses). The NCCL backend takes CUDA
///    tensors of its device. Outputs are written in place, so autograd version counters are not
///    bumped.
///  - On a CPU backend wait() blocks the host until the data has arrived. On NCCL it blocks
///    nothing: it makes the caller's current CUDA stream wait for the collective, as c10d's
///    Work::wait() does, so work queued on that stream afterwards sees the result.
///  - Each operation is bounded by the group's timeout. On a CPU backend, when it expires the
///    Work fails with a CollectiveError naming the op, its sequence number, the group and the
///    ranks that did not arrive; the group is then unusable (every later operation fails at
///    once). NCCL groups defer to c10d's watchdog, which aborts the communicator after the same
///    timeout and records the collectives in c10d's own flight recorder.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp {

/// How reductions combine values. kAvg divides the sum by the group size (floating types only).
enum class ReduceOp { kSum, kAvg, kMax, kMin };
const char* to_string(ReduceOp op);  ///< "sum", "avg", "max" or "min".

/// The kinds of collective, used to index the per-group counters.
enum class CollectiveKind : int { kAllGather = 0, kReduceScatter, kAllReduce, kBroadcast, kBarrier };
constexpr int kNumCollectiveKinds = 5;  ///< the number of CollectiveKind values
/// "all_gather", "reduce_scatter", "all_reduce", "broadcast" or "barrier".
const char* to_string(CollectiveKind kind);

/// What one group did for one kind of collective, as seen by this rank.
struct CollectiveCounters {
  int64_t calls = 0;           ///< operations issued
  int64_t bytes_sent = 0;      ///< payload bytes this rank put on the wire
  int64_t bytes_received = 0;  ///< payload bytes this rank took off the wire
  int64_t busy_ns = 0;         ///< time the group's communication thread spent running them
  int64_t blocked_ns = 0;      ///< time callers spent blocked in Work::wait() for them
  // busy_ns - blocked_ns is the communication time hidden behind the callers' other work.
};

/// A snapshot of a group's counters. Indexed by kind: stats[CollectiveKind::kAllGather].calls.
struct CollectiveStats {
  std::array<CollectiveCounters, kNumCollectiveKinds> by_kind{};  ///< one entry per CollectiveKind, in its order
  /** @{ */
  /// The counters of one kind.
  const CollectiveCounters& operator[](CollectiveKind k) const { return by_kind[static_cast<int>(k)]; }
  CollectiveCounters& operator[](CollectiveKind k) { return by_kind[static_cast<int>(k)]; }
  /** @} */
  int64_t total_calls() const;  ///< calls of every kind together
};

/// The error a failed collective reports (timeout, a peer that went away, a group made
/// unusable by an earlier failure).
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
struct StatsCell;  ///< a group's counters, shared with its Works (process_group.cpp)

/// How a Work completes when its collective runs on a device stream (NCCL) instead of the
/// group's communication thread.
class DeviceCompletion {
 public:
  virtual ~DeviceCompletion() = default;
  /// Makes the calling thread's current stream wait for the collective; the host does not block.
  virtual void wait_on_current_stream() = 0;
  /// Whether the collective has finished on the device. Never blocks.
  virtual bool is_completed() = 0;
};
}  // namespace detail

/// Handle of one queued collective, shared by the caller and the group's communication thread.
/// Thread-safe. Only a ProcessGroup creates and completes one; callers wait on it.
class Work {
 public:
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  /// Blocks until the operation finished. Rethrows its error (a CollectiveError) if it failed.
  /// Calling it again after completion returns (or rethrows) at once. Time spent blocked here
  /// is added to the group's blocked_ns counter. A collective on a device stream (NCCL) blocks
  /// the caller's current stream instead of the host; CUDA tensors staged through the host are
  /// copied back on that stream.
  void wait();
  /// True once the operation finished, successfully or not. Never blocks.
  bool is_completed() const;

  CollectiveKind kind() const { return kind_; }  ///< which collective this is
  /// The group's sequence number of this operation (0 for the group's first collective).
  int64_t seq() const { return seq_; }

 private:
  friend class ProcessGroup;  ///< creates Works and completes them (for its implementations)

  Work(CollectiveKind kind, int64_t seq, std::shared_ptr<detail::StatsCell> stats)
      : kind_(kind), seq_(seq), stats_(std::move(stats)) {}
  /// Records the outcome, drops the kept tensors and wakes the waiters. Called once.
  void finish(std::exception_ptr error);
  void wait_on_device();
  void run_after_host_wait();

  const CollectiveKind kind_;
  const int64_t seq_;
  const std::shared_ptr<detail::StatsCell> stats_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<at::Tensor> tensors_;                   ///< kept alive until finish()
  std::shared_ptr<detail::DeviceCompletion> device_;  ///< set when the collective runs on a stream
  std::function<void()> after_host_wait_;             ///< staged CUDA outputs: the copy back, once
};
/// What every collective returns: shared by the caller and the group until done.
using WorkHandle = std::shared_ptr<Work>;

/// A group of ranks that communicate. Obtain one from fsdp::world(), fsdp::new_group() or a
/// DeviceMesh; never construct one directly. Methods are safe to call from any thread, but the
/// order in which collectives are issued must be the same on every member.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /** @{ */
  /// This process's rank within the group, and the number of members.
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(global_ranks_.size()); }
  /** @} */
  /// The members' ranks in the world group, in group-rank order.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  /// A name unique among the groups of this program, used in errors and store keys.
  const std::string& name() const { return name_; }
  /// How long each of its collectives may take before it fails with CollectiveError.
  std::chrono::milliseconds timeout() const { return timeout_; }
  /** @{ */
  /// The backend's name ("gloo", "mpi", "nccl") and the device type of the tensors it moves
  /// directly (CPU backends take CUDA tensors too, staged through the host).
  virtual const char* backend_name() const = 0;
  virtual c10::DeviceType device_type() const { return c10::DeviceType::CPU; }
  /** @} */

  /// output[i * n : (i + 1) * n] = input of group rank i, n = input.numel().
  /// Requires output.numel() == size() * input.numel(). Writes straight into `output`.
  WorkHandle all_gather_into(const at::Tensor& output, const at::Tensor& input);
  /// The uneven form: rank i contributes counts[i] elements (input.numel() == counts[rank()]);
  /// output is their concatenation (numel == sum of counts). Counts may be zero.
  WorkHandle all_gather_v(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& counts);
  /// A real reduce-scatter: rank i receives op over all ranks of input[i * n : (i + 1) * n],
  /// n = output.numel(); it receives only its own chunk. Requires
  /// input.numel() == size() * output.numel(). `input` is not modified.
  WorkHandle reduce_scatter_into(const at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::kSum);
  /// The uneven form: rank i receives counts[i] elements (output.numel() == counts[rank()]),
  /// taken at offset counts[0] + ... + counts[i - 1] of input (numel == sum of counts).
  WorkHandle reduce_scatter_v(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& counts,
                              ReduceOp op = ReduceOp::kSum);
  /// In place: tensor = op over all ranks of tensor. The result is bitwise identical on all ranks.
  /// `after` (optional): a collective of another group, issued earlier on this rank, that writes
  /// `tensor` (e.g. a reduce-scatter's output, all-reduced over a second group as HSDP does). The
  /// all-reduce takes its place in this group's order now, but starts only once `after` finished,
  /// and fails without running if `after` failed. Where the group runs its collectives on its own
  /// communication thread (gloo, mpi, CPU tensors), that thread waits and the call returns at once;
  /// otherwise the call first waits for `after` as Work::wait() does (NCCL: the caller's stream
  /// waits; CUDA tensors staged through the host: the host waits, then the output is copied back).
  WorkHandle all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum, WorkHandle after = nullptr);
  /// In place: tensor = tensor of group rank `root`.
  WorkHandle broadcast(const at::Tensor& tensor, int root = 0);
  /// Completes on each rank once every member has called it.
  WorkHandle barrier();

  /** @{ */
  /// The counters of this group as seen by this rank, and their reset. Counters move when an
  /// operation is issued (calls) and as bytes are transferred (bytes), so read them after wait().
  CollectiveStats stats() const;
  void reset_stats();
  /** @} */

 protected:
  /// For the backends: this rank's place in the group, the members' world ranks, its name, its timeout.
  ProcessGroup(int rank, std::vector<int> global_ranks, std::string name, std::chrono::milliseconds timeout);

  /// One queued operation, as handed to the implementation. Sizes are already validated.
  struct Op {
    CollectiveKind kind;               ///< which collective
    ReduceOp reduce = ReduceOp::kSum;  ///< reduce-scatter, all-reduce
    at::Tensor output;                 ///< all-gather, reduce-scatter
    at::Tensor input;                  ///< all-gather, reduce-scatter; the tensor of all-reduce/broadcast
    std::vector<int64_t> counts;       ///< per-rank element counts (gather/scatter forms)
    int root = 0;                      ///< broadcast
    /// The operation starts only once this finished (all_reduce's `after`). Set only for a group
    /// of device type CPU given CPU tensors; its implementation waits with wait_for_predecessor().
    WorkHandle after;
  };
  /// Queue `op` for execution in issue order and return its handle.
  virtual WorkHandle enqueue(Op op) = 0;

  /** @{ */
  /// Implementations add bytes as they move them, and the time each operation ran.
  void count_bytes(CollectiveKind kind, int64_t sent, int64_t received);
  void count_busy(CollectiveKind kind, int64_t nanoseconds);
  /** @} */
  /// A new Work for the next enqueued operation: takes its sequence number, bumps the call
  /// counter. `keep_alive` holds tensors the operation uses until the Work is finished.
  WorkHandle make_work(CollectiveKind kind, std::vector<at::Tensor> keep_alive = {});
  /// A Work whose collective completes on a device stream (NCCL): `completion` waits for it.
  WorkHandle make_device_work(CollectiveKind kind, std::vector<at::Tensor> keep_alive,
                              std::shared_ptr<detail::DeviceCompletion> completion);
  /// Completes `work`: records its outcome (null = success), releases the tensors it kept alive
  /// and wakes its waiters. Implementations call it exactly once per Work, from any thread.
  static void finish_work(Work& work, std::exception_ptr error = nullptr);
  /// Blocks until `op.after` (if set) finished, and rethrows its error. For implementations that
  /// run operations on a thread of their own: the time is not counted as a caller's blocked time.
  static void wait_for_predecessor(const Op& op);

 private:
  const int rank_;
  const std::vector<int> global_ranks_;
  const std::string name_;
  const std::chrono::milliseconds timeout_;
  /// Checks the tensors' device against device_type() and stages CUDA tensors of a CPU backend
  /// through pinned host memory around enqueue().
  WorkHandle submit(Op op);
  void check_device(const at::Tensor& t, const char* what) const;

  const std::shared_ptr<detail::StatsCell> stats_;
  int64_t next_seq_ = 0;  ///< guarded by the StatsCell's mutex
};

}  // namespace fsdp
