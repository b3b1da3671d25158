// The backend-independent half of fsdp::ProcessGroup: argument checks, sequence numbers,
// counters, the Work handle, and the flight recorder's "enqueued" and "finished" records, so
// that every implementation is recorded. Implementations (gloo_backend.cpp) only run operations.
#include <fsdp/process_group.h>

#include <fsdp/flight_recorder.h>

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
}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> lock(mu_);
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
  TORCH_CHECK(t.device().is_cpu(), "fsdp collective on group '", group, "': ", what, " is on ", t.device(),
              " but this process group's backend (gloo) handles CPU tensors only");
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
  return enqueue(std::move(op));
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
  return enqueue(std::move(op));
}

WorkHandle ProcessGroup::all_reduce(const at::Tensor& tensor, ReduceOp reduce) {
  check_tensor(tensor, "tensor", name_);
  check_reduce_op(reduce, tensor, name_);
  Op op;
  op.kind = CollectiveKind::kAllReduce;
  op.reduce = reduce;
  op.input = tensor;
  return enqueue(std::move(op));
}

WorkHandle ProcessGroup::broadcast(const at::Tensor& tensor, int root) {
  check_tensor(tensor, "tensor", name_);
  TORCH_CHECK(root >= 0 && root < size(), "broadcast on group '", name_, "': root ", root,
              " is not a rank of this group of ", size());
  Op op;
  op.kind = CollectiveKind::kBroadcast;
  op.input = tensor;
  op.root = root;
  return enqueue(std::move(op));
}

WorkHandle ProcessGroup::barrier() {
  Op op;
  op.kind = CollectiveKind::kBarrier;
  return enqueue(std::move(op));
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

void ProcessGroup::finish_work(Work& work, std::exception_ptr error) {
  if (work.stats_) {
    FlightRecorder& recorder = FlightRecorder::global();
    recorder.finished(work.stats_->group, work.seq(), error == nullptr);
    if (error) recorder.note_failure(message_of(error));  // dumps, when dumps are enabled
  }
  work.finish(std::move(error));
}

}  // namespace fsdp
