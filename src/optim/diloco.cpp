// diloco.cpp — DiLoCo's outer loop (fsdp/diloco.h): which fragment's turn it is, its
// pseudo-gradient averaged over the replicas (the one collective here, issued and waited for in
// outer_step), and the outer Nesterov SGD, as torch.optim.SGD(momentum, nesterov) defines it.
#include <fsdp/diloco.h>

#include "src/tensor/quantized_all_reduce.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {
namespace {

void check_options(const DiLoCoOptions& o, size_t params) {
  TORCH_CHECK(o.inner_steps() >= 1, "DiLoCo: inner_steps must be at least 1, got ", o.inner_steps(),
              "; the paper's is 500");
  TORCH_CHECK(o.outer_lr() > 0, "DiLoCo: outer_lr must be positive, got ", o.outer_lr(), "; the paper's is 0.7");
  TORCH_CHECK(o.outer_momentum() >= 0 && o.outer_momentum() < 1, "DiLoCo: outer_momentum must be in [0, 1), got ",
              o.outer_momentum(), "; the paper's is 0.9");
  TORCH_CHECK(o.fragments() >= 1 && o.fragments() <= o.inner_steps(), "DiLoCo: fragments must be 1 to inner_steps (",
              o.inner_steps(), "), got ", o.fragments());
  TORCH_CHECK(static_cast<size_t>(o.fragments()) <= params, "DiLoCo: ", o.fragments(),
              " fragments need at least as many parameters, but there are ", params, "; pass fewer fragments");
  if (o.quantized()) o.quantized()->check("DiLoCo: quantized");
  TORCH_CHECK(!o.quantized() || !o.quantized()->skip_zero_blocks(),
              "DiLoCo: quantized with skip_zero_blocks is not supported yet (a pseudo-gradient is rarely zero "
              "block-wise); turn skip_zero_blocks off");
}

}  // namespace

DiLoCo::DiLoCo(std::vector<at::Tensor> params, DiLoCoOptions options)
    : params_(std::move(params)), options_(std::move(options)) {
  TORCH_CHECK(!params_.empty(), "DiLoCo: no parameters given");
  check_options(options_, params_.size());
  at::NoGradGuard no_grad;
  int64_t total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK(p.defined() && at::isFloatingType(p.scalar_type()), "DiLoCo: parameter ", i,
                " is not a floating-point tensor (", p.defined() ? c10::toString(p.scalar_type()) : "undefined",
                "); pass only the parameters the inner optimizer steps");
    anchor_.push_back(p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
    momentum_.push_back(at::zeros_like(anchor_.back()));
    total += p.numel();
  }
  // Consecutive parameters, about total / P elements per fragment, each holding at least one.
  const int64_t parts = options_.fragments();
  fragments_.resize(parts);
  int64_t seen = 0, current = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t remaining = static_cast<int64_t>(params_.size() - i);
    int64_t want = total > 0 ? std::min<int64_t>(parts - 1, seen * parts / total) : 0;
    want = std::max<int64_t>(want, parts - remaining);  // leaves one parameter for each later fragment
    if (!fragments_[current].params.empty() && want > current) ++current;
    fragments_[current].params.push_back(i);
    fragments_[current].numel += params_[i].numel();
    seen += params_[i].numel();
  }
  for (int64_t p = 0; p < parts; ++p) fragments_[p].offset = p * options_.inner_steps() / parts;
}

int64_t DiLoCo::step() {
  ++inner_steps_;
  int64_t synced = 0;
  for (const Fragment& f : fragments_) {
    if (inner_steps_ % options_.inner_steps() != f.offset) continue;
    outer_step(f);
    ++synced;
  }
  outer_steps_ += synced;
  return synced;
}

void DiLoCo::outer_step(const Fragment& f) {
  at::NoGradGuard no_grad;
  at::Tensor delta = at::empty({f.numel}, anchor_[f.params.front()].options());
  int64_t offset = 0;
  for (size_t i : f.params) {
    const int64_t n = anchor_[i].numel();
    at::Tensor piece = delta.narrow(0, offset, n);
    piece.copy_(anchor_[i].reshape({-1}));
    piece.sub_(params_[i].detach().reshape({-1}));
    offset += n;
  }
  const std::shared_ptr<ProcessGroup>& group = options_.process_group();
  if (group && group->size() > 1) {
    if (options_.quantized()) {
      const detail::QuantizedAllReduce q =
          detail::issue_quantized_all_reduce(delta, *group, *options_.quantized(), ReduceOp::kAvg);
      q.work->wait();
      detail::finish_quantized_all_reduce(q, delta);
    } else {
      group->all_reduce(delta, ReduceOp::kAvg)->wait();
    }
  }
  const double mu = options_.outer_momentum(), lr = options_.outer_lr();
  offset = 0;
  for (size_t i : f.params) {
    const int64_t n = anchor_[i].numel();
    const at::Tensor g = delta.narrow(0, offset, n).view(anchor_[i].sizes());
    momentum_[i].mul_(mu).add_(g);
    anchor_[i].sub_(options_.nesterov() ? g.add(momentum_[i], mu) : momentum_[i], lr);
    params_[i].detach().copy_(anchor_[i]);
    offset += n;
  }
}

}  // namespace fsdp
