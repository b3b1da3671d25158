// parity_training.h — the suite's one parity check: a model trained under FSDP (or replicate)
// on this rank's rows of each global batch must follow an unsharded copy trained in one process
// on the whole batch (losses at every step, full parameters at the end). The fully_shard,
// replicate, frozen-parameter, container and communication-control tests all use it, each with
// its own batches, losses, optimizer and per-step checks (ParityOptions).
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
  // The global batch of a step, the same on every rank (default: parity_batch).
  std::function<at::Tensor(int64_t step, int64_t rows)> batch;
  // A side's loss from its output and its rows (default: parity_loss).
  std::function<at::Tensor(const at::Tensor& out, const at::Tensor& x)> loss;
  // Each side's optimizer (default: Adam, lr 1e-2).
  std::function<std::unique_ptr<torch::optim::Optimizer>(torch::nn::Module&)> optimizer;
  // At the start of each step, on each side (the FSDP model first): freezing, a forward under
  // no_grad, ... as the test does to both.
  std::function<void(torch::nn::Module& module, bool is_reference, int step)> before_both;
  // Called on the FSDP side before each step's forward; returning false skips the step on both
  // sides (the FSDP side did something else, e.g. a failed iteration).
  std::function<bool(int step, const at::Tensor& local)> before_step = [](int, const at::Tensor&) { return true; };
  // The FSDP side's loss of a step (default: forward, then `loss`). The reference always
  // computes loss(forward(reference, global), global).
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor& local)> fsdp_loss;
  // After the FSDP side's backward, before its optimizer step (the reference has stepped): the
  // test's own checks of gradients or collectives, or the user's own synchronization.
  std::function<void(torch::nn::Module& model, torch::nn::Module& reference, int step)> after_backward;
  // Every parameter of the FSDP side must have a gradient after backward (not so with frozen or
  // unused parameters).
  bool every_parameter_gets_a_gradient = true;
  // Each parameter of the FSDP side at the end, before its values are compared (its placement).
  std::function<void(const std::string& name, const at::Tensor& param)> check_parameter;
};

// The one parity check of the suite: `model` (sharded, replicated or both) trains on this rank's
// rows of each global batch, `reference` on the whole batch in this process, each with its own
// optimizer; the mean loss over the ranks matches the reference's at every step (1e-5), and every
// parameter, gathered whole, at the end. `forward(module, x)` runs a model (through fsdp::call
// on the FSDP side). Call it inside fsdp::testing::run_distributed, on every rank.
inline void expect_training_parity(const std::shared_ptr<torch::nn::Module>& reference,
                                   const std::shared_ptr<torch::nn::Module>& model,
                                   const std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)>& forward,
                                   const std::string& what, const ParityOptions& o = ParityOptions()) {
  const int W = get_world_size(), r = get_rank();
  auto batch = o.batch ? o.batch : [&o](int64_t step, int64_t rows) { return parity_batch(step, rows, o.features); };
  auto loss_of = o.loss ? o.loss : parity_loss;
  auto make_optimizer =
      o.optimizer ? o.optimizer : [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(m.parameters(), torch::optim::AdamOptions(1e-2));
  };
  std::unique_ptr<torch::optim::Optimizer> ref_opt = make_optimizer(*reference), opt = make_optimizer(*model);
  for (int step = 0; step < o.steps; ++step) {
    at::Tensor global = batch(step, o.rows_per_rank * W);
    at::Tensor local = global.slice(0, r * o.rows_per_rank, (r + 1) * o.rows_per_rank);
    if (o.before_both) {
      o.before_both(*model, /*is_reference=*/false, step);
      o.before_both(*reference, /*is_reference=*/true, step);
    }
    opt->zero_grad();
    if (!o.before_step(step, local)) continue;

    ref_opt->zero_grad();
    at::Tensor ref_loss = loss_of(forward(*reference, global), global);
    ref_loss.backward();
    ref_opt->step();

    at::Tensor loss = o.fsdp_loss ? o.fsdp_loss(*model, local) : loss_of(forward(*model, local), local);
    loss.backward();
    if (o.every_parameter_gets_a_gradient) {
      for (const auto& item : model->named_parameters()) {
        EXPECT_TRUE(item.value().grad().defined()) << what << " step " << step << ": no gradient on " << item.key();
      }
    }
    if (o.after_backward) o.after_backward(*model, *reference, step);
    opt->step();

    at::Tensor mean = loss.detach().clone().reshape({1});
    world()->all_reduce(mean, ReduceOp::kAvg)->wait();
    EXPECT_NEAR(mean.item<double>(), ref_loss.item<double>(), 1e-5) << what << " step " << step;
  }
  auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    ASSERT_TRUE(ref_params.contains(item.key())) << item.key();
    if (o.check_parameter) o.check_parameter(item.key(), item.value());
    at::Tensor full =
        is_sharded_parameter(item.value()) ? as_dtensor(item.value()).full_tensor() : item.value().detach();
    const at::Tensor& expect = ref_params[item.key()];
    ASSERT_EQ(full.sizes(), expect.sizes()) << item.key();
    EXPECT_LT((full - expect).abs().max().item<double>(), 1e-5) << what << ": " << item.key();
  }
}

}  // namespace testing
}  // namespace fsdp
