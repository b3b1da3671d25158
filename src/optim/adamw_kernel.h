// adamw_kernel.h — the arithmetic of one AdamW step over many parameters' memory in one pass.
// Stateless: FusedAdamW (fused_adamw.cpp) decides which parameters form a run, owns their state
// and counts their steps; this file only updates the bytes it is pointed at. It never allocates
// a tensor and never looks at a TensorImpl.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace fsdp {
namespace optim {
namespace detail {

// The scalars of one parameter's update, as torch::optim::AdamW computes them (in double, from
// the group's options and the parameter's step count after incrementing it). The kernel
// rounds them to the parameter's dtype, as ATen does with the scalar operands of its ops.
struct AdamWCoefficients {
  double weight_decay_factor;  // 1 - lr * weight_decay
  double beta1;
  double beta2;
  double sqrt_bias_correction2;  // sqrt(1 - beta2^step)
  double eps;
  double negative_step_size;  // -lr / (1 - beta1^step)
};

// One parameter's memory: `numel` contiguous elements of the same dtype in each buffer.
// max_exp_avg_sq is null without amsgrad. The buffers of one span must not overlap each other,
// nor any buffer of another span of the same call except the gradients (read only).
struct AdamWSpan {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;
  int64_t numel;
  AdamWCoefficients coefficients;
};

// Applies one AdamW step to every element of every span, in place: one at::parallel_for over
// the spans' elements taken together, so a run of small parameters is split over the threads
// like one large one. Per element, in the order of torch::optim::AdamW's ops:
//   p *= decay; m = m*b1 + (1-b1)*g; v = v*b2 + (1-b2)*g*g; [vmax = max(vmax, v); v' = vmax]
//   p += (-step_size * m) / (sqrt(v') * (1 / sqrt(bc2)) + eps)
// Each operation rounds to the dtype, as between ATen's ops. Not bitwise AdamW's: 1 / sqrt(bc2)
// is a multiplication, and ATen's add may fuse its multiply-add; each differs by at most an ulp.
// dtype: kFloat or kDouble (the caller routes other dtypes elsewhere). Blocks until done.
void adamw_update(c10::ScalarType dtype, const std::vector<AdamWSpan>& spans);

}  // namespace detail
}  // namespace optim
}  // namespace fsdp
