// The backend-independent half of fsdp::ProcessGroup: argument checks, sequence numbers,
// counters, the Work handle, and the flight recorder's "enqueued" and "finished" records, so
// that every implementation is recorded. Implementations (gloo_backend.cpp) only run operations.
#include <fsdp/process_group.h>

#include <fsdp/flight_recorder.h>

#include "src/device/stream_check.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <numeric>

namespace fsdp {

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "?";
}

int64_t CollectiveStats::total_calls() const {
  int64_t n = 0;
  for (const auto& c : by_kind) n += c.calls;
  return n;
}

namespace detail {
struct StatsCell {
  std::mutex mu;
  CollectiveStats stats;
  std::string group;  // the group's name, for the flight recorder's "finished" record
};
}  // namespace detail

// ------------------------------------------------------------------------------ Work

void Work::wait() {
  if (device_) {
    wait_on_device();
    return;
  }
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (!done_) {
      const auto start = std::chrono::steady_clock::now();
      cv_.wait(lock, [&] { return done_; });
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
      if (stats_) {
        std::lock_guard<std::mutex> stats_lock(stats_->mu);
        stats_->stats[kind_].blocked_ns += ns.count();
      }
    }
    error = error_;
  }
  if (error) std::rethrow_exception(error);
  run_after_host_wait();
}

// The copy back of a staged CUDA output, once, on the stream of the first caller of wait().
void Work::run_after_host_wait() {
  std::function<void()> after;
  {
    std::lock_guard<std::mutex> lock(mu_);
    after.swap(after_host_wait_);
  }
  if (after) after();
}

// A collective on a device stream: the caller's stream waits for it, the host does not. c10d's
// watchdog owns its timeout; an error it already saw is reported here, naming the group.
void Work::wait_on_device() {
  std::exception_ptr error;
  try {
    device_->wait_on_current_stream();
  } catch (const std::exception& e) {
    error = std::make_exception_ptr(
        CollectiveError(c10::str("fsdp: the ", to_string(kind_), " #", seq_, " on group '",
                                 stats_ ? stats_->group : std::string("?"), "' failed on the device: ", e.what())));
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = !done_;
  }
  if (first) {
    if (stats_) FlightRecorder::global().finished(stats_->group, seq_, error == nullptr);
    finish(error);
  }
  if (error) std::rethrow_exception(error);
}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!done_ && device_) return device_->is_completed();
  return done_;
}

void Work::finish(std::exception_ptr error) {
  std::vector<at::Tensor> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
    release.swap(tensors_);  // drop our references outside the lock
  }
  cv_.notify_all();
}

// ------------------------------------------------------------------------------ ProcessGroup

ProcessGroup::ProcessGroup(int rank, std::vector<int> global_ranks, std::string name, std::chrono::milliseconds timeout)
    : rank_(rank),
      global_ranks_(std::move(global_ranks)),
      name_(std::move(name)),
      timeout_(timeout),
      stats_(std::make_shared<detail::StatsCell>()) {
  stats_->group = name_;
  FlightRecorder::global().register_group(name_, global_ranks_);
}

namespace {

void check_tensor(const at::Tensor& t, const char* what, const std::string& group) {
  TORCH_CHECK(t.defined(), "fsdp collective on group '", group, "': ", what, " is undefined");
  TORCH_CHECK(t.is_contiguous(), "fsdp collective on group '", group, "': ", what,
              " must be contiguous; call .contiguous() first");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const std::string& group) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "fsdp collective on group '", group, "': input dtype ",
              b.scalar_type(), " differs from output dtype ", a.scalar_type());
}

void check_counts(const std::vector<int64_t>& counts, int size, const std::string& group) {
  TORCH_CHECK(static_cast<int>(counts.size()) == size, "fsdp collective on group '", group, "': got ", counts.size(),
              " counts for a group of ", size, " ranks");
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "fsdp collective on group '", group, "': negative count ", c);
  }
}

void check_reduce_op(ReduceOp op, const at::Tensor& t, const std::string& group) {
  TORCH_CHECK(op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), "fsdp collective on group '", group,
              "': ReduceOp avg needs a floating dtype, got ", t.scalar_type(), "; use sum and divide yourself");
}

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }

}  // namespace

WorkHandle ProcessGroup::all_gather_into(const at::Tensor& output, const at::Tensor& input) {
  TORCH_CHECK(output.defined() && input.defined() && output.numel() == size() * input.numel(),
              "all_gather_into on group '", name_, "': output has ", output.defined() ? output.numel() : -1,
              " elements but needs group size ", size(), " x input ", input.defined() ? input.numel() : -1,
              "; use all_gather_v for uneven sizes");
  return all_gather_v(output, input, std::vector<int64_t>(size(), input.numel()));
}

WorkHandle ProcessGroup::all_gather_v(const at::Tensor& output, const at::Tensor& input,
                                      const std::vector<int64_t>& counts) {
  check_tensor(output, "output", name_);
  check_tensor(input, "input", name_);
  check_same_dtype(output, input, name_);
  check_counts(counts, size(), name_);
  TORCH_CHECK(input.numel() == counts[rank_], "all_gather_v on group '", name_, "': input has ", input.numel(),
              " elements but counts[", rank_, "] = ", counts[rank_]);
  TORCH_CHECK(output.numel() == sum(counts), "all_gather_v on group '", name_, "': output has ", output.numel(),
              " elements but the counts add up to ", sum(counts));
  Op op;
  op.kind = CollectiveKind::kAllGather;
  op.output = output;
  op.input = input;
  op.counts = counts;
  return submit(std::move(op));
}

WorkHandle ProcessGroup::reduce_scatter_into(const at::Tensor& output, const at::Tensor& input, ReduceOp reduce) {
  TORCH_CHECK(output.defined() && input.defined() && input.numel() == size() * output.numel(),
              "reduce_scatter_into on group '", name_, "': input has ", input.defined() ? input.numel() : -1,
              " elements but needs group size ", size(), " x output ", output.defined() ? output.numel() : -1,
              "; use reduce_scatter_v for uneven sizes");
  return reduce_scatter_v(output, input, std::vector<int64_t>(size(), output.numel()), reduce);
}

WorkHandle ProcessGroup::reduce_scatter_v(const at::Tensor& output, const at::Tensor& input,
                                          const std::vector<int64_t>& counts, ReduceOp reduce) {
  check_tensor(output, "output", name_);
  check_tensor(input, "input", name_);
  check_same_dtype(output, input, name_);
  check_counts(counts, size(), name_);
  check_reduce_op(reduce, output, name_);
  TORCH_CHECK(output.numel() == counts[rank_], "reduce_scatter_v on group '", name_, "': output has ", output.numel(),
              " elements but counts[", rank_, "] = ", counts[rank_]);
  TORCH_CHECK(input.numel() == sum(counts), "reduce_scatter_v on group '", name_, "': input has ", input.numel(),
              " elements but the counts add up to ", sum(counts));
  TORCH_CHECK(output.numel() == 0 || output.data_ptr() != input.data_ptr(), "reduce_scatter on group '", name_,
              "': output must not alias input");
  Op op;
  op.kind = CollectiveKind::kReduceScatter;
  op.reduce = reduce;
  op.output = output;
  op.input = input;
  op.counts = counts;
  return submit(std::move(op));
}

WorkHandle ProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp reduce, WorkHandle after) {
  check_tensor(tensor, "tensor", name_);
  check_reduce_op(reduce, tensor, name_);
  Op op;
  op.kind = CollectiveKind::kAllReduce;
  op.reduce = reduce;
  op.input = tensor;
  op.after = std::move(after);
  return submit(std::move(op));
}

WorkHandle ProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  check_tensor(tensor, "tensor", name_);
  TORCH_CHECK(root >= 0 && root < size(), "broadcast on group '", name_, "': root ", root,
              " is not a rank of this group of ", size());
  Op op;
  op.kind = CollectiveKind::kBroadcast;
  op.input = tensor;
  op.root = root;
  return submit(std::move(op));
}

WorkHandle ProcessGroup::barrier() {
  Op op;
  op.kind = CollectiveKind::kBarrier;
  return submit(std::move(op));
}

void ProcessGroup::check_device(const at::Tensor& t, const char* what) const {
  const c10::DeviceType type = t.device().type();
  const bool direct = type == device_type();
  const bool staged = device_type() == c10::DeviceType::CPU && type == c10::DeviceType::CUDA;
  TORCH_CHECK(direct || staged, "fsdp collective on group '", name_, "': ", what, " is on ", t.device(),
              " but this group's backend (", backend_name(), ") moves ", c10::DeviceTypeName(device_type()), " tensors",
              device_type() == c10::DeviceType::CPU ? " (and CUDA tensors, staged through the host)" : "",
              "; build the group for that device (init_device_mesh(\"", c10::DeviceTypeName(type, true), "\", ...))");
}

namespace {

// A host copy of a device tensor, in pinned memory, holding its data now (the copy is done on
// the current stream and waited for: the host collective reads it next).
at::Tensor stage_to_host(const at::Tensor& t, bool copy_data) {
  at::Tensor host = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
  if (copy_data) host.copy_(t, /*non_blocking=*/false);
  return host;
}

}  // namespace

// CUDA tensors on a CPU backend travel through pinned host memory: inputs are copied to the host
// before the operation is queued; the output comes back on the stream of the thread that calls
// wait(), after the host operation finished. The copies cost two transfers over PCIe per
// collective: this exists for several ranks sharing one GPU, where NCCL cannot run.
WorkHandle ProcessGroup::submit(Op op) {
  const at::Tensor& any = op.input.defined() ? op.input : op.output;
  if (op.output.defined()) check_device(op.output, "output");
  if (op.input.defined()) check_device(op.input, "input");
  const bool staged = any.defined() && any.device().type() != device_type();
  // Only a communication thread can wait for `after` in the caller's stead; a device stream waits
  // through Work::wait(), a staged input is copied to the host right here, so it must be complete
  // first, and the CPU's checking mode must see the issuing stream wait for it.
  if (op.after &&
      (staged || device_type() != c10::DeviceType::CPU || op.after->device_ || device::stream_check::enabled())) {
    op.after->wait();
    op.after.reset();
  }
  if (!staged) {
    if (!device::stream_check::enabled() || device_type() != c10::DeviceType::CPU) return enqueue(std::move(op));
    // The CPU's checking mode sees the collective as work on a stream of the group's own, after
    // the issuing stream's; the stream of the first wait() waits for it, as NCCL's would.
    const char* kind = to_string(op.kind);
    const at::Tensor input = op.input, written = op.output.defined() ? op.output : op.input;
    WorkHandle work = enqueue(std::move(op));
    const device::Event end = device::stream_check::collective(name_, kind, {input}, {written});
    std::lock_guard<std::mutex> lock(work->mu_);
    work->after_host_wait_ = [end] { device::stream_check::wait_on_current_stream(end); };
    return work;
  }
  TORCH_CHECK(!op.output.defined() || op.output.device() == op.input.device(), "fsdp collective on group '", name_,
              "': input on ", op.input.device(), " but output on ", op.output.device());
  const bool in_place = !op.output.defined();  // all-reduce, broadcast
  at::Tensor device_result = in_place ? op.input : op.output;
  at::Tensor host_input = stage_to_host(op.input, true);
  at::Tensor host_result = in_place ? host_input : stage_to_host(op.output, false);
  op.input = host_input;
  if (!in_place) op.output = host_result;
  WorkHandle work = enqueue(std::move(op));
  std::lock_guard<std::mutex> lock(work->mu_);
  work->after_host_wait_ = [device_result, host_result]() mutable {
    device_result.copy_(host_result, /*non_blocking=*/true);  // the pinned block stays ours until it ran
  };
  return work;
}

CollectiveStats ProcessGroup::stats() const {
  std::lock_guard<std::mutex> lock(stats_->mu);
  return stats_->stats;
}

void ProcessGroup::reset_stats() {
  std::lock_guard<std::mutex> lock(stats_->mu);
  stats_->stats = CollectiveStats{};
}

void ProcessGroup::count_bytes(CollectiveKind kind, int64_t sent, int64_t received) {
  std::lock_guard<std::mutex> lock(stats_->mu);
  stats_->stats[kind].bytes_sent += sent;
  stats_->stats[kind].bytes_received += received;
}

void ProcessGroup::count_busy(CollectiveKind kind, int64_t nanoseconds) {
  std::lock_guard<std::mutex> lock(stats_->mu);
  stats_->stats[kind].busy_ns += nanoseconds;
}

WorkHandle ProcessGroup::make_work(CollectiveKind kind, std::vector<at::Tensor> keep_alive) {
  int64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(stats_->mu);
    stats_->stats[kind].calls += 1;
    seq = next_seq_++;
  }
  // The flight record names the op's largest tensor (all-gather output, reduce-scatter input).
  int64_t bytes = 0;
  const char* dtype = "";
  for (const auto& t : keep_alive) {
    if (!t.defined() || static_cast<int64_t>(t.nbytes()) < bytes) continue;
    bytes = static_cast<int64_t>(t.nbytes());
    dtype = c10::toString(t.scalar_type());
  }
  FlightRecorder::global().enqueued(name_, to_string(kind), seq, bytes, dtype);
  WorkHandle work(new Work(kind, seq, stats_));  // Work's constructor is private: no make_shared
  work->tensors_ = std::move(keep_alive);
  return work;
}

WorkHandle ProcessGroup::make_device_work(CollectiveKind kind, std::vector<at::Tensor> keep_alive,
                                          std::shared_ptr<detail::DeviceCompletion> completion) {
  WorkHandle work = make_work(kind, std::move(keep_alive));
  work->device_ = std::move(completion);
  return work;
}

namespace {

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

void ProcessGroup::wait_for_predecessor(const Op& op) {
  if (!op.after) return;
  Work& work = *op.after;
  std::unique_lock<std::mutex> lock(work.mu_);
  work.cv_.wait(lock, [&] { return work.done_; });
  if (work.error_) std::rethrow_exception(work.error_);
}

void ProcessGroup::finish_work(Work& work, std::exception_ptr error) {
  if (work.stats_) {
    FlightRecorder& recorder = FlightRecorder::global();
    recorder.finished(work.stats_->group, work.seq(), error == nullptr);
    if (error) recorder.note_failure(message_of(error));  // dumps, when dumps are enabled
  }
  work.finish(std::move(error));
}

}  // namespace fsdp
