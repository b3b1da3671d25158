// queued_process_group.h — the part every CPU backend shares: a process group whose operations
// run one at a time, in issue order, on one communication thread of the group's own.
//
// It owns the queue, the thread and the bookkeeping around each operation (the flight
// recorder's "started" record, busy time, the trace event, completing the Work, and refusing
// everything after a failure). A backend only says how one operation runs: execute().
#pragma once

#include <fsdp/process_group.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdp {
namespace comm {

class QueuedProcessGroup : public ProcessGroup {
 public:
  ~QueuedProcessGroup() override;
  const char* backend_name() const override { return backend_.c_str(); }

 protected:
  // `backend` names the backend in trace events ("gloo", "mpi").
  QueuedProcessGroup(int rank, std::vector<int> global_ranks, std::string name, std::chrono::milliseconds timeout,
                     std::string backend);

  // Starts the communication thread. Call it last in the backend's constructor, once everything
  // execute() uses exists.
  void start_thread();
  // Lets the queued operations run, then joins the thread; later enqueues are refused. A
  // backend's destructor calls it first, while the members execute() uses still exist.
  // Calling it again does nothing.
  void stop_thread();

  // Queues `op` (sequence numbers follow queue order) and returns its Work. A backend that
  // refuses some operations checks them first, on the caller's thread, then calls this.
  WorkHandle enqueue(Op op) override;

  // Runs one operation on the communication thread and returns when its data has arrived.
  // Failures throw a CollectiveError whose message is what the caller's wait() reports; the
  // group then runs nothing more.
  virtual void execute(const Op& op, int64_t seq) = 0;

  // A scratch area of at least `nbytes` for execute(), kept for later operations (communication
  // thread only): first-touching freshly mapped pages can cost more than the transfer itself (on
  // a 2-vCPU VM, ~100 ms to fault in 32 MiB against ~25 ms to move it). Allocated through
  // LibTorch, so memory accounting sees it.
  char* scratch(size_t nbytes);

 private:
  struct Task {
    Op op;
    WorkHandle work;
  };
  void run_loop();
  void run(Task& task);
  void wait_for_input(Task& task);

  const std::string backend_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::string broken_;  // why the group is unusable; empty while healthy (communication thread only)
  at::Tensor scratch_;  // see scratch()
  std::thread thread_;
};

}  // namespace comm
}  // namespace fsdp
