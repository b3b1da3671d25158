// reducer.cpp — bucket assignment, the gradient-ready hooks, issuing each bucket's all-reduce as
// soon as it is full, and the end-of-backward step. Every collective of a synced backward is
// issued here, in bucket order, on every rank: that order never depends on which gradients a rank
// happened to compute, which is what keeps ranks from hanging.
#include "src/ddp/reducer.h"

#include "src/autograd/recomputation.h"  // the end-of-backward callback under checkpointing

#include "src/util/compat.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstring>
#include <map>

namespace fsdp {
namespace detail {
namespace {

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Runs after the parameter's AccumulateGrad node: param.grad holds this backward's gradient
// (plus whatever it held before). Holds the reducer weakly: a hook may outlive it.
struct GradientReadyHook : torch::autograd::FunctionPostHook {
  GradientReadyHook(std::weak_ptr<Reducer> reducer, size_t index) : reducer(std::move(reducer)), index(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto r = reducer.lock()) r->on_gradient_ready(index);
    return outputs;
  }
  std::weak_ptr<Reducer> reducer;
  size_t index;
};

// dst = src for two tensors of the same dtype and numel; one memcpy when src is contiguous.
void copy_values(const at::Tensor& dst, const at::Tensor& src) {
  if (src.is_contiguous() && dst.is_contiguous()) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(bytes_of(src)));
  } else {
    at::NoGradGuard no_grad;
    dst.copy_(src.view_as(dst));
  }
}

// A tensor over `numel` elements of `flat`'s storage from `offset`, shaped `sizes`, that is not an
// autograd view: LibTorch's Optimizer::zero_grad() calls detach_() on param.grad, which refuses views.
at::Tensor alias_of(const at::Tensor& flat, int64_t offset, c10::IntArrayRef sizes) {
  at::NoGradGuard no_grad;
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, sizes);
  return t;
}

}  // namespace

std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params, int64_t first_cap_bytes,
                                                int64_t cap_bytes) {
  struct Open {
    std::vector<size_t> members;
    int64_t bytes = 0;
    bool first = true;
  };
  std::map<at::ScalarType, Open> open;  // one open bucket per dtype
  std::vector<std::vector<size_t>> buckets;
  for (size_t k = params.size(); k-- > 0;) {
    Open& b = open[params[k].scalar_type()];
    b.members.push_back(k);
    b.bytes += bytes_of(params[k]);
    if (b.bytes >= (b.first ? first_cap_bytes : cap_bytes)) {
      buckets.push_back(std::move(b.members));
      b = Open{{}, 0, false};
    }
  }
  for (auto& item : open) {
    if (!item.second.members.empty()) buckets.push_back(std::move(item.second.members));
  }
  // Expected readiness order: the bucket whose first parameter comes last in registration first.
  std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.front() > b.front(); });
  return buckets;
}

Reducer::Reducer(std::vector<std::pair<std::string, at::Tensor>> params, DeviceMesh mesh,
                 std::weak_ptr<torch::nn::Module> module, ReducerOptions options)
    : mesh_(std::move(mesh)), group_(mesh_.get_group(0)), module_(std::move(module)), options_(options) {
  std::vector<at::Tensor> tensors;
  for (auto& item : params) {
    tensors.push_back(item.second);
    Param p;
    p.fqn = std::move(item.first);
    p.tensor = std::move(item.second);
    params_.push_back(std::move(p));
  }
  for (auto& members : assign_buckets(tensors, options_.first_bucket_cap_bytes, options_.bucket_cap_bytes)) {
    Bucket b;
    int64_t numel = 0;
    for (size_t i : members) {
      params_[i].bucket = buckets_.size();
      params_[i].offset = numel;
      numel += params_[i].tensor.numel();
    }
    b.flat = at::zeros({numel}, params_[members.front()].tensor.options().requires_grad(false));
    for (size_t i : members) {
      Param& p = params_[i];
      p.slot = alias_of(b.flat, p.offset, p.tensor.sizes());
    }
    b.pending = members.size();
    b.params = std::move(members);
    buckets_.push_back(std::move(b));
  }
  if (options_.find_unused_parameters) used_map_ = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
  if (options_.gradient_as_bucket_view) {
    for (Param& p : params_) {
      if (p.tensor.grad().defined()) copy_into_slot(p);
    }
  }
}

Reducer::~Reducer() {
  for (Param& p : params_) {
    if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }
}

void Reducer::install_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
    TORCH_CHECK(p.accumulator, "fsdp::replicate: parameter '", p.fqn,
                "' has no gradient accumulator (is it a leaf "
                "that requires grad?)");
    p.hook_key = compat::add_post_hook(*p.accumulator, std::make_unique<GradientReadyHook>(weak_from_this(), i));
  }
}

std::vector<BucketInfo> Reducer::buckets() const {
  std::vector<BucketInfo> out;
  for (const Bucket& b : buckets_) {
    BucketInfo info;
    for (size_t i : b.params) info.parameter_names.push_back(params_[i].fqn);
    info.bytes = bytes_of(b.flat);
    info.dtype = b.flat.scalar_type();
    out.push_back(std::move(info));
  }
  return out;
}

// ------------------------------------------------------------------------------ backward

void Reducer::on_gradient_ready(size_t index) {
  Param& p = params_[index];
  p.used = true;  // kept across unsynced backwards, as DDP's used map is
  if (!requires_gradient_sync_) return;
  if (!in_backward_) begin_backward();
  // An error here would abort backward before the end-of-backward callback runs, leaving this
  // rank's buckets half issued; it is kept and raised by that callback instead, after every
  // bucket was reduced (so peers do not hang).
  try {
    if (p.ready) {
      // A second gradient in one backward (a parameter used inside and outside a reentrant
      // checkpoint): fine until its bucket is on the wire, wrong after.
      TORCH_CHECK(!buckets_[p.bucket].work, "fsdp::replicate: parameter '", p.fqn,
                  "' received a second gradient "
                  "in one backward after its bucket's all-reduce was issued (it is used both inside and outside a "
                  "reentrant-checkpointed region, or reached twice by one backward); DDP does not support this either");
      copy_into_slot(p);
      return;
    }
    copy_into_slot(p);
  } catch (const c10::Error& e) {
    if (deferred_error_.empty()) deferred_error_ = e.what_without_backtrace();
    if (p.ready) return;
    p.slot.zero_();
  }
  p.ready = true;
  if (--buckets_[p.bucket].pending == 0) launch_full_buckets();
}

void Reducer::begin_backward() {
  in_backward_ = true;
  std::weak_ptr<Reducer> weak = weak_from_this();
  // Under reentrant checkpointing this may run inside a nested backward; the callback is kept
  // for the outer one, which is the backward that ends the step.
  RecomputationScope::queue_end_of_backward_callback([weak] {
    if (auto r = weak.lock()) r->end_of_backward();
  });
}

void Reducer::copy_into_slot(Param& p) {
  const at::Tensor& grad = p.tensor.grad();
  if (options_.gradient_as_bucket_view && grad.data_ptr() == p.slot.data_ptr()) return;  // accumulated in place
  TORCH_CHECK(grad.layout() == at::kStrided, "fsdp::replicate: parameter '", p.fqn,
              "' got a sparse gradient; "
              "replicate() reduces dense gradients only");
  TORCH_CHECK(grad.scalar_type() == p.slot.scalar_type() && grad.sizes() == p.slot.sizes(),
              "fsdp::replicate: "
              "parameter '",
              p.fqn, "' has a gradient of dtype ", grad.scalar_type(), " and shape ", grad.sizes(),
              " but its bucket was built for ", p.slot.scalar_type(), " ", p.slot.sizes(),
              "; change dtypes and shapes (module->to(...)) before replicate()");
  copy_values(p.slot, grad);
  if (options_.gradient_as_bucket_view) point_grad_at_slot(p);
}

void Reducer::point_grad_at_slot(Param& p) {
  // An alias, so that what the optimizer does to param.grad's handle leaves the slot alone.
  p.tensor.mutable_grad() = alias_of(buckets_[p.bucket].flat, p.offset, p.slot.sizes());
}

// Buckets go on the wire strictly in order, so every rank issues the same collectives in the
// same order whatever order its gradients arrived in.
void Reducer::launch_full_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    Bucket& b = buckets_[next_bucket_++];
    b.work = group_->all_reduce(b.flat, ReduceOp::kAvg);
  }
}

void Reducer::end_of_backward() {
  in_backward_ = false;
  std::vector<std::string> missing;
  std::vector<bool> used;
  try {
    fill_missing_gradients(&missing);
    launch_full_buckets();
    used = globally_used();
    for (Bucket& b : buckets_) b.work->wait();
  } catch (...) {
    reset_for_next_backward();
    deferred_error_.clear();
    throw;
  }
  write_gradients(used);
  reset_for_next_backward();
  const std::string error = std::move(deferred_error_);
  deferred_error_.clear();
  check_accumulators_unchanged();
  TORCH_CHECK(error.empty(), error);
  if (missing.empty() || options_.find_unused_parameters) return;
  std::string names;
  for (size_t i = 0; i < missing.size() && i < 20; ++i) names += (i ? ", '" : "'") + missing[i] + "'";
  if (missing.size() > 20) names += ", ... (" + std::to_string(missing.size()) + " in all)";
  TORCH_CHECK(false, "fsdp::replicate: on rank ", group_->rank(),
              " these parameters got no gradient in this "
              "backward: ",
              names,
              ". Every bucket was still reduced (zeros for them), but DDP's default expects "
              "every trainable parameter to take part in the loss. If some are unused on purpose (in some steps or "
              "on some ranks), pass ReplicateOptions().find_unused_parameters(true); if they are never used, set "
              "requires_grad(false) on them before replicate()");
}

// LibTorch gives a parameter a new gradient accumulator when set_data() changes its dtype or
// device (module->to(...)); the hooks are on the old one, so its gradients would never arrive.
void Reducer::check_accumulators_unchanged() const {
  std::string names;
  for (const Param& p : params_) {
    // This reducer holds the accumulator, so the tensor's weak reference to it only ends when
    // LibTorch drops it.
    if (torch::autograd::impl::try_get_grad_accumulator(p.tensor) == p.accumulator) continue;
    names += (names.empty() ? "'" : ", '") + p.fqn + "'";
  }
  TORCH_CHECK(names.empty(), "fsdp::replicate: parameters ", names,
              " changed dtype or device after replicate() "
              "(module->to(...)), which gave them new gradient accumulators that replicate() does not hook; change "
              "dtypes and devices before replicate()");
}

// Parameters whose hook did not fire take part with what param.grad holds (gradients accumulated
// without sync) or zeros, so that their buckets are reduced on every rank.
void Reducer::fill_missing_gradients(std::vector<std::string>* missing) {
  for (Param& p : params_) {
    if (p.ready) continue;
    missing->push_back(p.fqn);
    try {
      if (p.tensor.grad().defined()) {
        copy_into_slot(p);
      } else {
        p.slot.zero_();
      }
    } catch (const c10::Error& e) {  // raised after every bucket was reduced
      if (deferred_error_.empty()) deferred_error_ = e.what_without_backtrace();
      p.slot.zero_();
    }
    p.ready = true;
    --buckets_[p.bucket].pending;
  }
}

// find_unused_parameters: which parameters some rank used (one all-reduce of a flag per
// parameter, issued after the buckets). Empty: all of them.
std::vector<bool> Reducer::globally_used() {
  if (!options_.find_unused_parameters) return {};
  int32_t* flags = used_map_.data_ptr<int32_t>();
  for (size_t i = 0; i < params_.size(); ++i) flags[i] = params_[i].used ? 1 : 0;
  group_->all_reduce(used_map_, ReduceOp::kMax)->wait();
  std::vector<bool> used(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) used[i] = flags[i] != 0;
  return used;
}

void Reducer::write_gradients(const std::vector<bool>& used) {
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (!used.empty() && !used[i]) continue;  // no rank used it: param.grad stays as it was (DDP)
    at::Tensor& grad = p.tensor.mutable_grad();
    if (!grad.defined()) {
      if (options_.gradient_as_bucket_view) {
        point_grad_at_slot(p);
      } else {
        grad = p.slot.clone();
      }
    } else if (grad.data_ptr() != p.slot.data_ptr() && grad.scalar_type() == p.slot.scalar_type() &&
               grad.sizes() == p.slot.sizes()) {  // a mismatch was reported by copy_into_slot
      copy_values(grad, p.slot);
    }
  }
}

void Reducer::reset_for_next_backward() {
  for (Param& p : params_) p.ready = p.used = false;
  for (Bucket& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
  }
  next_bucket_ = 0;
  in_backward_ = false;
}

}  // namespace detail
}  // namespace fsdp
