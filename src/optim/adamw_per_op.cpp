// adamw_per_op.cpp — AdamW's per-op update of one parameter (adamw_per_op.h).
#include "src/optim/adamw_per_op.h"

#include <ATen/ATen.h>

#include <cmath>
#include <memory>

namespace fsdp {
namespace optim {
namespace detail {

std::unique_ptr<torch::optim::AdamWParamState> new_adamw_state(const at::Tensor& like,
                                                               const torch::optim::AdamWOptions& options) {
  auto state = std::make_unique<torch::optim::AdamWParamState>();
  state->step(0);
  state->exp_avg(at::zeros_like(like, at::MemoryFormat::Preserve));
  state->exp_avg_sq(at::zeros_like(like, at::MemoryFormat::Preserve));
  if (options.amsgrad()) state->max_exp_avg_sq(at::zeros_like(like, at::MemoryFormat::Preserve));
  return state;
}

void adamw_step_per_op(at::Tensor& p, const at::Tensor& grad, torch::optim::AdamWParamState& state,
                       const torch::optim::AdamWOptions& options) {
  if (options.weight_decay() != 0) p.mul_(1 - options.lr() * options.weight_decay());
  if (options.amsgrad() && !state.max_exp_avg_sq().defined()) {
    state.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  }
  state.step(state.step() + 1);
  const double beta1 = std::get<0>(options.betas());
  const double beta2 = std::get<1>(options.betas());
  const double bias_correction1 = 1 - std::pow(beta1, state.step());
  const double bias_correction2 = 1 - std::pow(beta2, state.step());
  state.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
  state.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  at::Tensor second_moment = state.exp_avg_sq();
  if (options.amsgrad()) {
    at::max_out(state.max_exp_avg_sq(), state.exp_avg_sq(), state.max_exp_avg_sq());
    second_moment = state.max_exp_avg_sq();
  }
  const at::Tensor denom = (second_moment.sqrt() / std::sqrt(bias_correction2)).add_(options.eps());
  p.addcdiv_(state.exp_avg(), denom, -(options.lr() / bias_correction1));
}

}  // namespace detail
}  // namespace optim
}  // namespace fsdp
