// The NCCL backend (nccl_backend.h). Every collective is one c10d call issued from the caller's
// thread, on the caller's current stream's behalf: c10d makes its NCCL stream wait for that
// stream, runs the collective and records its end, and Work::wait() makes the waiter's stream
// wait for the end. The uneven forms, which NCCL has no primitive for, run the even collective on
// buffers padded to the largest count and copy the pieces on the issuing stream.
//
// A group is bound to this rank's GPU and its communicator made when the group is created (what
// c10d does for init_process_group(device_id=...)), so that NCCL's refusals, such as two ranks on
// one GPU, come from init_device_mesh. When c10d's watchdog finds a collective timed out, it
// aborts the group's communicators (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, nccl_settings.h), and from
// then on each collective of the group fails at its wait() with a CollectiveError, as on Gloo.
#include "src/comm/nccl_backend.h"

#include "src/comm/nccl_settings.h"
#include "src/device/device_ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>
#include <exception>
#include <sstream>

namespace fsdp {
namespace comm {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kAvg: return c10d::ReduceOp(c10d::ReduceOp::AVG);
    case ReduceOp::kMax: return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kMin: return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  TORCH_CHECK(false, "internal: reduce op ", static_cast<int>(op));
}

// A c10d collective, and for the padded forms the event after their copy-out on the issuing
// stream, which is what a waiter must wait for then.
class NcclCompletion final : public detail::DeviceCompletion {
 public:
  NcclCompletion(c10::intrusive_ptr<c10d::Work> work, device::Event after) : work_(std::move(work)), after_(after) {}
  void wait_on_current_stream() override {
    if (after_.empty()) {
      work_->wait();
      return;
    }
    device::DeviceOps& ops = device::ops_for(c10::DeviceType::CUDA);
    ops.wait(ops.current_stream(c10::Device(c10::DeviceType::CUDA)), after_);
  }
  bool is_completed() override { return work_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  device::Event after_;
};

// c10d's options for a group: its timeout, and the name and members its flight recorder and
// watchdog messages show.
c10::intrusive_ptr<c10d::ProcessGroupNCCL::Options> options_for(const NcclGroupConfig& config) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = config.timeout;
  NcclGroupIdentity id = nccl_group_identity(config.name, config.global_ranks);
  options->group_name = std::move(id.group_name);
  options->group_desc = std::move(id.group_desc);
  options->global_ranks_in_group = std::move(id.global_ranks_in_group);
  return options;
}

// c10d's message without the C++ backtrace a c10::Error carries.
std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error ? error->what_without_backtrace() : e.what();
}

std::string ranks_str(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  return s.str();
}

class NcclProcessGroup final : public ProcessGroup {
 public:
  explicit NcclProcessGroup(NcclGroupConfig config)
      : ProcessGroup(config.rank, config.global_ranks, config.name, config.timeout), device_(config.device) {
    nccl_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        config.store, config.rank, static_cast<int>(config.global_ranks.size()), options_for(config));
    connect();
  }
  ~NcclProcessGroup() override {
    try {
      nccl_->shutdown();
    } catch (const std::exception&) {
      // A communicator already aborted by the watchdog has nothing left to shut down.
    }
  }
  const char* backend_name() const override { return "nccl"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }

 private:
  // Binds the group to this rank's GPU and makes its communicator now, with every member.
  void connect() {
    nccl_->setBoundDeviceId(device_);
    try {
      nccl_->eagerConnectSingleDevice(device_);
    } catch (const std::exception& e) {
      throw CollectiveError(c10::str("fsdp: NCCL group '", name(), "' (global ranks ", ranks_str(global_ranks()),
                                     ", this is group rank ", rank(), " on ", device_,
                                     ") could not be created: ", message_of(e), "\n", nccl_init_remedy(e.what())));
    }
  }

  // A c10d failure (an aborted communicator, NCCL's error) fails the Work at its wait(), where
  // fsdp::fully_shard names the module; misuse (a dtype NCCL lacks) still throws here.
  WorkHandle enqueue(Op op) override {
    check_on_my_device(op);
    const std::string broken = why_broken();
    if (!broken.empty()) return failed(op.kind, "was not run: " + broken);
    try {
      return issue(op);
    } catch (const c10::DistBackendError& e) {
      return failed(op.kind, std::string("failed: ") + e.what_without_backtrace());
    }
  }

  WorkHandle issue(Op& op) {
    switch (op.kind) {
      case CollectiveKind::kAllGather: return all_gather(op);
      case CollectiveKind::kReduceScatter: return reduce_scatter(op);
      case CollectiveKind::kAllReduce: return all_reduce(op);
      case CollectiveKind::kBroadcast: return broadcast(op);
      case CollectiveKind::kBarrier: return barrier();
    }
    TORCH_CHECK(false, "internal: collective kind ", static_cast<int>(op.kind));
  }

  // What c10d's watchdog found wrong with this group, "" when nothing.
  std::string why_broken() {
    switch (nccl_->getError()) {
      case c10d::ErrorType::SUCCESS: return "";
      case c10d::ErrorType::TIMEOUT:
        return c10::str("c10d's watchdog found a collective of this group still running after the group's timeout of ",
                        timeout().count(), " ms (it aborts the group's communicator)");
      case c10d::ErrorType::COMM_ERROR: return "NCCL reported an error on the group's communicator";
      case c10d::ErrorType::REMOTE_ERROR: return "another rank of the group reported an NCCL error";
    }
    return "c10d reports an error of an unknown kind on this group";
  }

  // A Work that has already failed: its wait() throws the CollectiveError.
  WorkHandle failed(CollectiveKind kind, const std::string& what) {
    WorkHandle work = make_work(kind);
    const int global_rank = global_ranks()[static_cast<size_t>(rank())];
    finish_work(*work,
                std::make_exception_ptr(CollectiveError(c10::str(
                    "fsdp: ", to_string(kind), " #", work->seq(), " on NCCL group '", name(), "' (global ranks ",
                    ranks_str(global_ranks()), ", this is rank ", global_rank, ", group rank ", rank(), ") ", what,
                    ". The group is now unusable: c10d's log above names the collective that failed "
                    "(WorkNCCL(SeqNum=...)), and its flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE, "
                    "TORCH_NCCL_DUMP_ON_TIMEOUT) what each rank ran. If a rank is only slow, raise the timeout "
                    "(fsdp::InitOptions().timeout(...) or FSDP_COLLECTIVE_TIMEOUT_MS)"))));
    return work;
  }

  void check_on_my_device(const Op& op) const {
    for (const at::Tensor* t : {&op.input, &op.output}) {
      TORCH_CHECK(!t->defined() || t->device() == device_, "fsdp collective on NCCL group '", name(), "': a tensor on ",
                  t->device(), " but this rank's group runs on ", device_,
                  "; move it there (each rank uses the GPU of its local rank)");
    }
  }

  static bool even(const std::vector<int64_t>& counts) {
    return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts.front(); });
  }

  WorkHandle device_work(const Op& op, c10::intrusive_ptr<c10d::Work> work, device::Event after = {}) {
    return make_device_work(op.kind, {op.input, op.output},
                            std::make_shared<NcclCompletion>(std::move(work), std::move(after)));
  }

  // The event that marks the end of the copies just queued on the current stream.
  device::Event mark_current() {
    device::DeviceOps& ops = device::ops_for(device_);
    return ops.record(ops.current_stream(device_));
  }

  WorkHandle all_gather(Op& op) {
    if (even(op.counts)) return device_work(op, nccl_->_allgather_base(op.output, op.input));
    const int64_t most = *std::max_element(op.counts.begin(), op.counts.end());
    at::Tensor padded_in = at::zeros({most}, op.input.options());
    padded_in.narrow(0, 0, op.input.numel()).copy_(op.input);
    at::Tensor padded_out = at::empty({most * size()}, op.input.options());
    auto work = nccl_->_allgather_base(padded_out, padded_in);
    work->wait();  // the issuing stream waits; the copies below follow on it
    int64_t at = 0;
    for (int q = 0; q < size(); ++q) {
      op.output.narrow(0, at, op.counts[q]).copy_(padded_out.narrow(0, q * most, op.counts[q]));
      at += op.counts[q];
    }
    return device_work(op, work, mark_current());
  }

  WorkHandle reduce_scatter(Op& op) {
    c10d::ReduceScatterOptions options;
    options.reduceOp = to_c10d(nccl_reduce_op(op.reduce, size()));
    if (even(op.counts)) return device_work(op, nccl_->_reduce_scatter_base(op.output, op.input, options));
    const int64_t most = *std::max_element(op.counts.begin(), op.counts.end());
    at::Tensor padded_in = at::zeros({most * size()}, op.input.options());
    int64_t at = 0;
    for (int q = 0; q < size(); ++q) {
      padded_in.narrow(0, q * most, op.counts[q]).copy_(op.input.narrow(0, at, op.counts[q]));
      at += op.counts[q];
    }
    at::Tensor padded_out = at::empty({most}, op.input.options());
    auto work = nccl_->_reduce_scatter_base(padded_out, padded_in, options);
    work->wait();
    op.output.copy_(padded_out.narrow(0, 0, op.output.numel()));
    return device_work(op, work, mark_current());
  }

  WorkHandle all_reduce(Op& op) {
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(nccl_reduce_op(op.reduce, size()));
    std::vector<at::Tensor> tensors{op.input};
    return device_work(op, nccl_->allreduce(tensors, options));
  }

  WorkHandle broadcast(Op& op) {
    c10d::BroadcastOptions options;
    options.rootRank = op.root;
    std::vector<at::Tensor> tensors{op.input};
    return device_work(op, nccl_->broadcast(tensors, options));
  }

  // An all-reduce of one element: every member has reached it when it completes.
  WorkHandle barrier() {
    Op op;
    op.kind = CollectiveKind::kBarrier;
    op.input = at::zeros({1}, at::TensorOptions().device(device_));
    std::vector<at::Tensor> tensors{op.input};
    return device_work(op, nccl_->allreduce(tensors, c10d::AllreduceOptions()));
  }

  c10::Device device_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl_;
};

std::shared_ptr<ProcessGroup> make_nccl_group(NcclGroupConfig config) {
  return std::make_shared<NcclProcessGroup>(std::move(config));
}

// Registered when the library is loaded, before any group exists.
const bool registered = [] {
  apply_nccl_env_defaults();
  nccl_group_factory() = &make_nccl_group;
  return true;
}();

}  // namespace
}  // namespace comm
}  // namespace fsdp
