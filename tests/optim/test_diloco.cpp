// DiLoCo (fsdp/diloco.h): the outer step against torch.optim.SGD(nesterov) on the pseudo-gradient
// in one process, the fragments' turns, replicas that end every outer step with the same
// parameters (fp32 and quantized) across real processes, and the refusals.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/device_mesh.h>
#include <fsdp/diloco.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <vector>

using fsdp::DiLoCo;
using fsdp::DiLoCoOptions;
using fsdp::testing::run_distributed;

namespace {

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

// Moves every parameter as an inner optimizer would.
void inner_move(std::vector<at::Tensor>& params, int64_t step) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i)
    params[i].add_(at::sin(at::arange(params[i].numel()).view(params[i].sizes()) * (step + 1.0 + i)) * 0.1);
}

}  // namespace

// One replica: every H inner steps the parameters become anchor - lr x (Nesterov of the
// pseudo-gradient), as torch.optim.SGD(lr, momentum, nesterov) gives stepping the anchor with
// the pseudo-gradient as its gradient.
TEST(DiLoCo, OuterStepIsNesterovSgdOnThePseudoGradient) {
  for (bool nesterov : {true, false}) {
    std::vector<at::Tensor> params = {at::randn({5, 3}), at::randn({7})};
    std::vector<at::Tensor> anchor = clones(params);
    for (auto& a : anchor) a.requires_grad_(true);
    torch::optim::SGD outer(anchor, torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(nesterov));
    DiLoCo diloco(params, DiLoCoOptions().inner_steps(3).nesterov(nesterov));
    for (int64_t step = 0; step < 9; ++step) {
      inner_move(params, step);
      const bool due = (step + 1) % 3 == 0;
      std::vector<at::Tensor> pseudo;
      for (size_t i = 0; i < params.size(); ++i) pseudo.push_back(anchor[i].detach() - params[i]);
      EXPECT_EQ(diloco.step(), due ? 1 : 0) << "step " << step;
      if (!due) continue;
      for (size_t i = 0; i < params.size(); ++i) anchor[i].mutable_grad() = pseudo[i];
      outer.step();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::allclose(params[i], anchor[i].detach(), 1e-6, 1e-6)) << "step " << step << " param " << i;
      }
    }
    EXPECT_EQ(diloco.outer_step_count(), 3);
    EXPECT_EQ(diloco.inner_step_count(), 9);
  }
}

// P fragments, offsets floor(p H / P): with H = 4 and P = 2 fragment 1 syncs at steps 2, 6, ...
// and fragment 0 at 4, 8, ...; a fragment's turn leaves the other's parameters as they were.
TEST(DiLoCo, FragmentsTakeTurns) {
  std::vector<at::Tensor> params = {at::zeros({4}), at::zeros({4}), at::zeros({4}), at::zeros({4})};
  DiLoCo diloco(params, DiLoCoOptions().inner_steps(4).fragments(2).outer_lr(1.0).outer_momentum(0.0));
  std::vector<int64_t> synced;
  for (int64_t step = 1; step <= 8; ++step) {
    for (auto& p : params) p.add_(1.0);
    const int64_t n = diloco.step();
    if (n > 0) synced.push_back(step);
    EXPECT_LE(n, 1);
    if (step == 2) {
      // lr 1, no momentum: the synced fragment returns to its anchor plus the (one replica's) move.
      EXPECT_TRUE(at::equal(params[2], at::full({4}, 2.0)));
      EXPECT_TRUE(at::equal(params[0], at::full({4}, 2.0)));
    }
  }
  EXPECT_EQ(synced, (std::vector<int64_t>{2, 4, 6, 8}));
}

// Two replicas of a fully_shard model (2 x 1 mesh: the shard dim within a "host") on different
// data: between outer steps they differ; after each outer step they hold the same parameters,
// the anchor minus lr x the averaged pseudo-gradient. Quantized (int8) too.
TEST(DiLoCo, ReplicasMeetAtEveryOuterStep) {
  run_distributed(2, [] {
    for (bool quantized : {false, true}) {
      SCOPED_TRACE(quantized ? "int8" : "fp32");
      auto mesh = fsdp::init_device_mesh("cpu", {2, 1}, {"replicate", "shard"});
      torch::manual_seed(1);
      torch::nn::Linear model(6, 4);
      fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh["shard"]));
      torch::optim::AdamW inner(model->parameters(), torch::optim::AdamWOptions(1e-2));
      DiLoCoOptions opts;
      opts.inner_steps(3).process_group(mesh.get_group("replicate"));
      if (quantized) opts.quantized(fsdp::QuantizedComm());
      DiLoCo diloco(model->parameters(), opts);
      auto group = mesh.get_group("replicate");
      auto same = [&] {
        bool all = true;
        for (const auto& p : model->parameters()) {
          at::Tensor both = at::empty({2 * p.numel()});
          group->all_gather_into(both, p.detach().reshape({-1}).contiguous())->wait();
          all = all && at::equal(both.narrow(0, 0, p.numel()), both.narrow(0, p.numel(), p.numel()));
        }
        return all;
      };
      for (int64_t step = 0; step < 6; ++step) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * fsdp::get_rank() + step);
        at::Tensor x = at::randn({4, 6}, gen), y = at::randn({4, 4}, gen);
        inner.zero_grad();
        torch::nn::functional::mse_loss(fsdp::call(model, x), y).backward();
        inner.step();
        const bool outer = diloco.step() > 0;
        EXPECT_EQ(outer, (step + 1) % 3 == 0);
        EXPECT_EQ(same(), outer) << "step " << step;
      }
    }
  });
}

TEST(DiLoCo, RefusalsNameTheOption) {
  std::vector<at::Tensor> params = {at::zeros({4})};
  EXPECT_THROW(DiLoCo(params, DiLoCoOptions().inner_steps(0)), c10::Error);
  EXPECT_THROW(DiLoCo(params, DiLoCoOptions().outer_momentum(1.0)), c10::Error);
  EXPECT_THROW(DiLoCo(params, DiLoCoOptions().fragments(2)), c10::Error);  // one parameter
  EXPECT_THROW(DiLoCo({at::zeros({4}, at::kLong)}), c10::Error);
  try {
    DiLoCo(params, DiLoCoOptions().outer_lr(-1));
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("outer_lr must be positive, got -1"), std::string::npos);
  }
}
