// reducer.h — replicate()'s gradient reducer: the buckets (one flat buffer each, allocated once),
// the hooks on the parameters' gradient accumulators that fill them, the all-reduce each bucket
// issues when it is full, and the end-of-backward step that waits for them and writes param.grad.
// It owns every collective replicate() issues; it never gathers anything.
#pragma once

#include "src/composable/registry.h"

#include <fsdp/process_group.h>
#include <fsdp/replicate.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

struct ReducerOptions {
  int64_t bucket_cap_bytes = 0;
  int64_t first_bucket_cap_bytes = 0;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
};

// Which parameters share a bucket. `params` in registration order; returns buckets of indices
// into it, in the order they are reduced: reverse registration order, a bucket closed once it
// holds at least its cap (the first cap for the first bucket of a dtype, then the second), one
// dtype per bucket. DDP's assignment.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& params, int64_t first_cap_bytes,
                                                int64_t cap_bytes);

// replicate()'s state: the composable registry owns it while the module lives.
class Reducer : public composable::ModuleState, public std::enable_shared_from_this<Reducer> {
 public:
  // `params`: the trainable parameters with their names, in registration order.
  Reducer(std::vector<std::pair<std::string, at::Tensor>> params, DeviceMesh mesh,
          std::weak_ptr<torch::nn::Module> module, ReducerOptions options);
  // Removes the hooks (waiting out any all-reduce still in flight).
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Hooks every parameter's gradient accumulator. Called once, after construction (the hooks
  // hold a weak reference to this reducer).
  void install_hooks();

  const DeviceMesh& mesh() const { return mesh_; }
  std::shared_ptr<torch::nn::Module> module() const { return module_.lock(); }
  void set_requires_gradient_sync(bool sync) { requires_gradient_sync_ = sync; }
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  std::vector<BucketInfo> buckets() const;

  // From the hook of parameter `index`, after autograd accumulated its gradient into param.grad.
  void on_gradient_ready(size_t index);

 private:
  struct Param {
    std::string fqn;
    at::Tensor tensor;
    size_t bucket = 0;
    int64_t offset = 0;  // elements into its bucket
    at::Tensor slot;     // its piece of the bucket, shaped like the parameter
    // Kept alive: the tensor holds it weakly. Whatever smart pointer this LibTorch hands out.
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator;
    uintptr_t hook_key = 0;
    bool ready = false;  // its gradient is in the bucket for the current synced backward
    bool used = false;   // it got a gradient since the last synced backward ended
  };
  struct Bucket {
    at::Tensor flat;
    std::vector<size_t> params;
    size_t pending = 0;  // gradients still missing in the current synced backward
    WorkHandle work;     // set once its all-reduce is issued
  };

  void begin_backward();
  void copy_into_slot(Param& p);
  void launch_full_buckets();
  void end_of_backward();
  void fill_missing_gradients(std::vector<std::string>* missing);
  void check_accumulators_unchanged() const;
  std::vector<bool> globally_used();
  void write_gradients(const std::vector<bool>& used);
  void reset_for_next_backward();
  void point_grad_at_slot(Param& p);

  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  DeviceMesh mesh_;
  std::shared_ptr<ProcessGroup> group_;
  std::weak_ptr<torch::nn::Module> module_;
  ReducerOptions options_;
  bool requires_gradient_sync_ = true;
  bool in_backward_ = false;    // a synced backward has started and its callback is queued
  size_t next_bucket_ = 0;      // the next bucket whose all-reduce is to be issued
  at::Tensor used_map_;         // int32, one per parameter (find_unused_parameters)
  std::string deferred_error_;  // the first error a hook hit, raised at the end of backward
};

}  // namespace detail
}  // namespace fsdp
