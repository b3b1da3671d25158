// The communication thread every CPU backend runs its collectives on. Who waits: the caller,
// through Work::wait(); the thread completes each Work once its operation has run.
#include "src/comm/queued_process_group.h"

#include "src/util/tensor_bytes.h"

#include <fsdp/flight_recorder.h>
#include <fsdp/trace.h>

#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <utility>

namespace fsdp {
namespace comm {

using Clock = std::chrono::steady_clock;

QueuedProcessGroup::QueuedProcessGroup(int rank, std::vector<int> global_ranks, std::string name,
                                       std::chrono::milliseconds timeout, std::string backend)
    : ProcessGroup(rank, std::move(global_ranks), std::move(name), timeout), backend_(std::move(backend)) {}

QueuedProcessGroup::~QueuedProcessGroup() { stop_thread(); }

void QueuedProcessGroup::start_thread() {
  thread_ = std::thread([this] { run_loop(); });
}

void QueuedProcessGroup::stop_thread() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

WorkHandle QueuedProcessGroup::enqueue(Op op) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  TORCH_CHECK(!stopping_, "process group '", name(), "' is being destroyed; no new collectives");
  // Sequence numbers are taken under the queue lock so that they follow queue order.
  WorkHandle work = make_work(op.kind, {op.output, op.input});
  queue_.push_back(Task{std::move(op), work});
  queue_cv_.notify_one();
  return work;
}

void QueuedProcessGroup::run_loop() {
  // Backends reduce and divide through ATen views of raw buffers: no autograd bookkeeping wanted.
  c10::InferenceMode no_autograd;
  trace::set_thread_name("comm " + name());
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    run(task);
  }
}

// An operation that reads another group's output (Op::after) starts once that collective
// finished: this thread waits for it, not the caller. If it failed, the input was never written,
// and this group fails too, as the other members will miss this rank's part.
void QueuedProcessGroup::wait_for_input(Task& task) {
  if (!broken_.empty() || !task.op.after) return;
  try {
    wait_for_predecessor(task.op);
  } catch (const std::exception& e) {
    broken_ = std::string(to_string(task.op.kind)) + " #" + std::to_string(task.work->seq()) +
              " was not run: the collective whose output it reads failed (" + e.what() + ")";
  }
  task.op.after.reset();
}

void QueuedProcessGroup::run(Task& task) {
  std::exception_ptr error;
  const int64_t seq = task.work->seq();
  const char* kind = to_string(task.op.kind);
  wait_for_input(task);
  if (!broken_.empty()) {
    error = std::make_exception_ptr(
        CollectiveError(std::string("fsdp: ") + kind + " #" + std::to_string(seq) + " on process group '" + name() +
                        "' was not run: the group is unusable after an earlier failure (" + broken_ + ")"));
  } else {
    const auto start = Clock::now();
    FlightRecorder::global().started(name(), seq);
    try {
      execute(task.op, seq);
    } catch (const std::exception&) {  // execute() throws CollectiveErrors only
      broken_ = std::string(kind) + " #" + std::to_string(seq) + " failed";
      error = std::current_exception();
    }
    const auto end = Clock::now();
    count_busy(task.op.kind, std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count());
    if (trace::enabled()) {
      const int64_t bytes = task.op.input.defined() ? static_cast<int64_t>(task.op.input.nbytes()) : 0;
      trace::record("comm", std::string(kind) + " #" + std::to_string(seq), start, end,
                    "{\"group\": \"" + name() + "\", \"backend\": \"" + backend_ +
                        "\", \"input_bytes\": " + std::to_string(bytes) + "}");
    }
  }
  finish_work(*task.work, error);
}

char* QueuedProcessGroup::scratch(size_t nbytes) {
  if (!scratch_.defined() || scratch_.numel() < static_cast<int64_t>(nbytes)) {
    scratch_ = at::Tensor();  // free the old one first
    scratch_ = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte));
  }
  return detail::bytes_of(scratch_);
}

}  // namespace comm
}  // namespace fsdp
