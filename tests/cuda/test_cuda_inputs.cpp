// The root's pre-forward on a "cuda" mesh moves the forward's tensor inputs to the mesh's GPU,
// as FSDP2's does: CPU tokens (and CPU activations that need a gradient) go in as they are, and
// the step is the one with the inputs moved by hand. Without a GPU, or in a build without the
// CUDA path, each test reports skipped with the reason.
#include "cuda/cuda_testing.h"
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/device.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <string>
#include <vector>

using fsdp::testing::DistOptions;
using fsdp::testing::run_distributed;

namespace {

// W = 1 runs NCCL; W = 2 shares the one GPU through Gloo (NCCL refuses two ranks on one GPU).
DistOptions options_for(int world) {
  DistOptions o;
  if (world > 1) o.env["FSDP_CUDA_BACKEND"] = "gloo";
  return o;
}

at::Tensor cpu_tokens(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + step + 1000 * fsdp::get_rank());
  return at::randint(0, 8, {2, 16}, gen);
}

// Trains `steps` SGD steps on CPU tokens, moved to the GPU by hand or not; returns the losses and
// the sharded gradients of the last step.
std::pair<std::vector<double>, std::vector<at::Tensor>> train(fsdp::models::Transformer& model, bool move_by_hand,
                                                              c10::Device gpu, int steps = 3) {
  torch::optim::SGD opt(model->parameters(), 0.1);
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    opt.zero_grad();
    const at::Tensor toks = cpu_tokens(step);
    at::Tensor logits = fsdp::call(model, move_by_hand ? toks.to(gpu) : toks);
    EXPECT_TRUE(logits.is_cuda());
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}).to(gpu));
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().cpu());
  return {losses, grads};
}

}  // namespace

TEST(CudaInputs, CpuTokensIntoACudaRootTrainAsTokensMovedByHand) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    run_distributed(
        world,
        [] {
          auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          auto moved_by_fsdp = fsdp::testing::sharded(mesh);
          auto moved_by_hand = fsdp::testing::sharded(mesh);
          const auto [losses, grads] = train(moved_by_fsdp, false, mesh.device());
          const auto [ref_losses, ref_grads] = train(moved_by_hand, true, mesh.device());
          EXPECT_EQ(losses, ref_losses);
          ASSERT_EQ(grads.size(), ref_grads.size());
          for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(grads[i].equal(ref_grads[i])) << "parameter " << i;
        },
        options_for(world));
  }
}

// A CPU input that needs a gradient gets it back on the CPU, as from a .to(cuda) written by hand.
TEST(CudaInputs, ACpuInputOfACudaRootGetsItsGradientOnTheCpu) {
  SKIP_WITHOUT_GPU();
  run_distributed(1, [] {
    auto mesh = fsdp::init_device_mesh("cuda", {1});
    torch::manual_seed(1);
    torch::nn::Linear by_fsdp(4, 3), by_hand(4, 3);
    {
      at::NoGradGuard no_grad;
      by_hand->weight.copy_(by_fsdp->weight);
      by_hand->bias.copy_(by_fsdp->bias);
    }
    fsdp::fully_shard(by_fsdp, fsdp::FullyShardOptions().mesh(mesh));
    fsdp::fully_shard(by_hand, fsdp::FullyShardOptions().mesh(mesh));
    const at::Tensor x = at::randn({5, 4}).requires_grad_(true);
    const at::Tensor x_ref = x.detach().clone().requires_grad_(true);
    at::Tensor y = fsdp::call(by_fsdp, x);
    at::Tensor y_ref = fsdp::call(by_hand, x_ref.to(mesh.device()));
    EXPECT_TRUE(y.is_cuda());
    EXPECT_TRUE(y.equal(y_ref));
    y.square().sum().backward();
    y_ref.square().sum().backward();
    ASSERT_TRUE(x.grad().defined());
    EXPECT_TRUE(x.grad().is_cpu());
    EXPECT_TRUE(x.grad().equal(x_ref.grad()));
  });
}
