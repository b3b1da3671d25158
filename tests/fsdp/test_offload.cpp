// CPUOffloadPolicy across real processes: on a CPU mesh the host is the device, so an offloaded
// model trains bitwise like one that is not, also after module->to(dtype); what this build cannot
// do is refused with errors that name it.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <optional>
#include <string>

using fsdp::CPUOffloadPolicy;
using fsdp::testing::run_distributed;

namespace {

fsdp::models::Transformer sharded_transformer(const fsdp::DeviceMesh& mesh,
                                              const std::optional<CPUOffloadPolicy>& offload) {
  torch::manual_seed(0);
  fsdp::models::ModelArgs args;
  args.dropout_p = 0.0;
  fsdp::models::Transformer model(args);
  auto opts = fsdp::FullyShardOptions().mesh(mesh).offload_policy(offload);
  for (auto& block : model->blocks()) fsdp::fully_shard(block, opts);
  fsdp::fully_shard(model, opts);
  return model;
}

at::Tensor loss_of(fsdp::models::Transformer& model, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step + 1000 * fsdp::get_rank());
  at::Tensor toks = at::randint(0, 8, {2, 16}, gen);
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
}

}  // namespace

TEST(CpuOffload, TrainsBitwiseLikeNoOffloadWithHostShardsGradsAndState) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      auto mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
      auto plain = sharded_transformer(mesh, std::nullopt);
      auto offloaded = sharded_transformer(mesh, CPUOffloadPolicy().pin_memory(false));
      torch::optim::Adam a(plain->parameters(), 1e-2), b(offloaded->parameters(), 1e-2);
      for (int64_t step = 0; step < 3; ++step) {
        a.zero_grad();
        b.zero_grad();
        loss_of(plain, step).backward();
        loss_of(offloaded, step).backward();
        a.step();
        b.step();
      }
      auto expected = plain->named_parameters();
      for (const auto& item : offloaded->named_parameters()) {
        EXPECT_TRUE(item.value().device().is_cpu()) << item.key();
        ASSERT_TRUE(item.value().grad().defined()) << item.key();
        EXPECT_TRUE(item.value().grad().device().is_cpu()) << item.key();
        EXPECT_TRUE(item.value().equal(expected[item.key()])) << item.key() << " differs from no offload";
      }
      for (const auto& item : fsdp::sharded_state_dict(*offloaded)) {
        EXPECT_TRUE(item.value().to_local().device().is_cpu()) << item.key() << ": state dicts hold host tensors";
      }
    });
  }
}

// module->to(dtype) after fully_shard re-lays the shards in host memory: an offloaded model goes
// on training bitwise like one that is not.
TEST(CpuOffload, PinnedMemoryIsRefusedAndToDtypeReLaysTheHostShards) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    try {
      sharded_transformer(mesh, CPUOffloadPolicy());  // pin_memory defaults to true, as in PyTorch
      ADD_FAILURE() << "expected pinned memory to be refused by a CPU build";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("pin_memory(false)"), std::string::npos) << e.what();
    }
    // A CPU build cannot move a shard off the host (set_data refuses other device types; the
    // refusal of a shard on another device is tests/cuda's), so what is checked here is the
    // other way a shard leaves FSDP's buffer: module->to(dtype).
    auto plain = sharded_transformer(mesh, std::nullopt);
    auto offloaded = sharded_transformer(mesh, CPUOffloadPolicy().pin_memory(false));
    plain->to(at::kDouble);
    offloaded->to(at::kDouble);
    torch::optim::Adam a(plain->parameters(), 1e-2), b(offloaded->parameters(), 1e-2);
    for (int64_t step = 0; step < 2; ++step) {
      a.zero_grad();
      b.zero_grad();
      loss_of(plain, step).backward();
      loss_of(offloaded, step).backward();
      a.step();
      b.step();
    }
    auto expected = plain->named_parameters();
    for (const auto& item : offloaded->named_parameters()) {
      EXPECT_TRUE(item.value().device().is_cpu()) << item.key();
      EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key();
      EXPECT_EQ(item.value().grad().scalar_type(), at::kDouble) << item.key();
      EXPECT_TRUE(item.value().equal(expected[item.key()])) << item.key() << " differs from no offload";
    }
  });
}
