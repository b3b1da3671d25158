// parity_training.h — the parity check of the container and communication-control tests: a
// model trained under FSDP on this rank's rows of each global batch must follow an unsharded
// copy trained in one process on the whole batch (losses at every step, full parameters at
// the end). Call it inside fsdp::testing::run_distributed.
#pragma once

#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>

#include <functional>
#include <memory>
#include <string>

namespace fsdp {
namespace testing {

// The global batch of a step: `rows` x `features`, the same on every rank.
inline at::Tensor parity_batch(int64_t step, int64_t rows, int64_t features) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return at::randn({rows, features}, gen);
}

inline at::Tensor parity_loss(const at::Tensor& out, const at::Tensor& x) {
  return (out - x.sum(1, true)).pow(2).mean();
}

struct ParityOptions {
  int steps = 4;
  int64_t rows_per_rank = 2;
  int64_t features = 5;
  // Called on the FSDP side before each step's forward; returning false skips the step on both
  // sides (the FSDP side did something else, e.g. a failed iteration).
  std::function<bool(int step, const at::Tensor& local)> before_step = [](int, const at::Tensor&) { return true; };
  // The FSDP side's loss of a step (default: forward, then parity_loss). The reference always
  // computes parity_loss(forward(reference, global), global).
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor& local)> fsdp_loss;
};

// `forward(module, x)` runs a model (through fsdp::call on the FSDP side).
inline void expect_training_parity(const std::shared_ptr<torch::nn::Module>& reference,
                                   const std::shared_ptr<torch::nn::Module>& model,
                                   const std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)>& forward,
                                   const std::string& what, const ParityOptions& o = ParityOptions()) {
  const int W = get_world_size(), r = get_rank();
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < o.steps; ++step) {
    at::Tensor global = parity_batch(step, o.rows_per_rank * W, o.features);
    at::Tensor local = global.slice(0, r * o.rows_per_rank, (r + 1) * o.rows_per_rank);
    opt.zero_grad();
    if (!o.before_step(step, local)) continue;

    ref_opt.zero_grad();
    at::Tensor ref_loss = parity_loss(forward(*reference, global), global);
    ref_loss.backward();
    ref_opt.step();

    at::Tensor loss = o.fsdp_loss ? o.fsdp_loss(*model, local) : parity_loss(forward(*model, local), local);
    loss.backward();
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(item.value().grad().defined()) << what << " step " << step << ": no gradient on " << item.key();
    }
    opt.step();

    at::Tensor mean = loss.detach().clone().reshape({1});
    world()->all_reduce(mean, ReduceOp::kAvg)->wait();
    EXPECT_NEAR(mean.item<double>(), ref_loss.item<double>(), 1e-5) << what << " step " << step;
  }
  auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    ASSERT_TRUE(ref_params.contains(item.key())) << item.key();
    at::Tensor full = is_sharded_parameter(item.value()) ? as_dtensor(item.value()).full_tensor() : item.value();
    const at::Tensor& expect = ref_params[item.key()];
    ASSERT_EQ(full.sizes(), expect.sizes()) << item.key();
    EXPECT_LT((full - expect).abs().max().item<double>(), 1e-5) << what << ": " << item.key();
  }
}

}  // namespace testing
}  // namespace fsdp
