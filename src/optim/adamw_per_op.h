// adamw_per_op.h — torch::optim::AdamW's update of one parameter, op for op (LibTorch's
// adamw.cpp), on whatever device its tensors live. FusedAdamW takes it for the parameters its
// fused pass cannot take; DeviceStateAdamW for every parameter, on the state's device.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/adamw.h>

namespace fsdp {
namespace optim {
namespace detail {

// AdamW's state for a parameter shaped like `like`: step 0, zero moments (and a zero
// max_exp_avg_sq under amsgrad), each a new tensor with `like`'s dtype, shape and device.
std::unique_ptr<torch::optim::AdamWParamState> new_adamw_state(const at::Tensor& like,
                                                               const torch::optim::AdamWOptions& options);

// One AdamW step of `param` with gradient `grad`, in place: weight decay, the moments in
// `state` (a zero max_exp_avg_sq added under amsgrad when missing), the step count, the update.
// Every tensor must be on one device. Blocks only as far as the ops do (not at all on a GPU).
void adamw_step_per_op(at::Tensor& param, const at::Tensor& grad, torch::optim::AdamWParamState& state,
                       const torch::optim::AdamWOptions& options);

}  // namespace detail
}  // namespace optim
}  // namespace fsdp
