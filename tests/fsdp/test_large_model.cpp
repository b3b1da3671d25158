// A model larger than one rank's memory (fsdp::models::sharded_transformer, the on_block_built
// hook of the Transformer, fsdp::memory::set_allocation_limit). Each rank runs under a cap on
// its live CPU tensor bytes that is smaller than the model's full parameters: building the
// model whole fails there, building it sharded block by block succeeds, gives the values of
// the whole build bit for bit, and trains like a model built whole in an uncapped process.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/transformer.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using fsdp::models::ModelArgs;
using fsdp::models::Transformer;
using fsdp::models::TransformerBlock;
using fsdp::models::TransformerBlockImpl;
using fsdp::models::TransformerImpl;

constexpr uint64_t kSeed = 7;
constexpr int64_t kBatchPerRank = 1;

// Mostly blocks (32 of them, 194 KiB each) and a small root: 6.1 MiB of fp32 parameters. The
// sequence and batch are short so that activations stay small next to the parameters.
ModelArgs large_args() {
  ModelArgs a;
  a.n_layers = 32;
  a.dim = 64;
  a.n_heads = 4;
  a.vocab_size = 64;
  a.max_seq_len = 8;
  a.dropout_p = 0.0;
  return a;
}

int64_t full_parameter_bytes(const ModelArgs& a) {
  const int64_t D = a.dim, V = a.vocab_size, S = a.max_seq_len, L = a.n_layers;
  return 4 * (2 * V * D + S * D + L * (12 * D * D + 9 * D) + 2 * D);
}

// The cap: three quarters of the full parameters, on top of what the process held before.
int64_t cap_bytes(const ModelArgs& a) { return full_parameter_bytes(a) * 3 / 4; }

// Sets the allocation limit to `cap` bytes above the live bytes now and resets the peak;
// removes it when it goes out of scope (also when a check throws).
class CappedPhase {
 public:
  explicit CappedPhase(int64_t cap) : base_(fsdp::memory::allocated_bytes()) {
    fsdp::memory::reset_peak_allocated();
    fsdp::memory::set_allocation_limit(base_ + cap);
  }
  ~CappedPhase() { fsdp::memory::set_allocation_limit(0); }
  // The most this phase held above the bytes live when it began.
  int64_t peak() const { return fsdp::memory::max_allocated_bytes() - base_; }

 private:
  int64_t base_;
};

// The global batch of one step (every rank draws it whole; it is small), and this rank's rows.
at::Tensor global_tokens(const ModelArgs& a, int world) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  return at::randint(a.vocab_size, {world * kBatchPerRank, a.max_seq_len + 1}, gen, at::kLong);
}

double loss_and_backward(Transformer& model, const at::Tensor& tokens) {
  const int64_t s = tokens.size(1) - 1;
  at::Tensor loss = fsdp::call_method(model, &TransformerImpl::forward_loss, tokens.narrow(1, 0, s),
                                      tokens.narrow(1, 1, s), int64_t{1});
  loss.backward();
  return loss.item<double>();
}

// The parameters of `sharded` gathered, against those of `whole` under the same names.
void expect_parameters_match(Transformer& sharded, Transformer& whole, bool bitwise) {
  const auto reference = whole->named_parameters();
  const fsdp::ShardedStateDict sd = fsdp::sharded_state_dict(*sharded);
  ASSERT_EQ(sd.size(), reference.size());
  for (const auto& item : sd) {
    const at::Tensor full = item.value().full_tensor();  // collective: every rank, same order
    const at::Tensor* expected = reference.find(item.key());
    ASSERT_NE(expected, nullptr) << item.key();
    if (bitwise) {
      EXPECT_TRUE(at::equal(full, *expected)) << item.key() << " differs from the whole build";
    } else {
      EXPECT_TRUE(at::allclose(full, *expected, 1e-5, 1e-6))
          << item.key() << ": max difference " << (full - *expected).abs().max().item<double>();
    }
  }
}

TEST(LargeModel, FullParametersExceedTheCap) {
  // The premise of the suite: the cap is below the model, so building it whole must fail.
  const ModelArgs a = large_args();
  ASSERT_GT(full_parameter_bytes(a), cap_bytes(a));
  torch::manual_seed(kSeed);
  Transformer probe(a);
  EXPECT_EQ(fsdp::models::count_parameters(*probe) * 4, full_parameter_bytes(a));
  probe = nullptr;
  CappedPhase capped(cap_bytes(a));
  try {
    torch::manual_seed(kSeed);
    Transformer whole(a);
    ADD_FAILURE() << "the whole model was built under a cap of " << cap_bytes(a) << " bytes";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CPU out of memory"), std::string::npos) << e.what();
  }
}

// W = 2: built under the cap, the shards hold exactly the values of the whole build.
TEST(LargeModel, BuiltShardedUnderTheCapEqualsTheWholeBuild) {
  fsdp::testing::run_distributed(2, [] {
    const ModelArgs a = large_args();
    auto mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
    const auto options = fsdp::FullyShardOptions().mesh(mesh);
    Transformer model{nullptr};
    int64_t peak = 0;
    {
      CappedPhase capped(cap_bytes(a));
      torch::manual_seed(kSeed);
      model = fsdp::models::sharded_transformer(a, options, options);
      peak = capped.peak();
    }
    std::printf(
        "rank %d: built sharded over 2 ranks, peak %.2f MiB of tensors; full parameters %.2f MiB, cap %.2f MiB\n",
        fsdp::get_rank(), peak / 1048576.0, full_parameter_bytes(a) / 1048576.0, cap_bytes(a) / 1048576.0);
    EXPECT_LT(peak, cap_bytes(a));
    // The registered parameters are this rank's shards: about half of the model.
    EXPECT_LE(fsdp::models::count_parameters(*model) * 4, full_parameter_bytes(a) / 2 + 4 * a.dim * 4);
    for (const auto& p : model->parameters()) EXPECT_TRUE(fsdp::is_sharded_parameter(p));

    // No cap from here: the reference, built whole the usual way.
    torch::manual_seed(kSeed);
    Transformer whole(a);
    expect_parameters_match(model, whole, /*bitwise=*/true);
  });
}

// The hook sees every block once, in order; a hook that draws no random numbers changes no value.
TEST(LargeModel, HookSeesEachBlockOnceAndChangesNoValue) {
  ModelArgs a;
  a.n_layers = 3;
  std::vector<const TransformerBlockImpl*> seen;
  torch::manual_seed(kSeed);
  Transformer hooked(a, [&](TransformerBlock& block) { seen.push_back(block.get()); });
  ASSERT_EQ(seen.size(), 3u);
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], hooked->blocks()[i].get());
  torch::manual_seed(kSeed);
  Transformer plain(a);
  const auto expected = plain->named_parameters();
  for (const auto& item : hooked->named_parameters()) EXPECT_TRUE(at::equal(item.value(), expected[item.key()]));
}

// W = 4: built and trained one step (SGD) under the cap; the result is that of the whole model
// trained on the whole global batch in a process without a cap.
TEST(LargeModel, TrainsOneStepUnderTheCapLikeTheWholeModel) {
  fsdp::testing::run_distributed(4, [] {
    const ModelArgs a = large_args();
    const int world = fsdp::get_world_size(), rank = fsdp::get_rank();
    auto mesh = fsdp::init_device_mesh("cpu", {world});
    const auto options = fsdp::FullyShardOptions().mesh(mesh);
    const at::Tensor tokens = global_tokens(a, world);
    Transformer model{nullptr};
    int64_t build_peak = 0, step_peak = 0;
    {
      CappedPhase capped(cap_bytes(a));
      torch::manual_seed(kSeed);
      model = fsdp::models::sharded_transformer(a, options, options);
      build_peak = capped.peak();
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5));
      loss_and_backward(model, tokens.narrow(0, rank * kBatchPerRank, kBatchPerRank));
      opt.step();
      opt.zero_grad();
      step_peak = capped.peak();
    }
    std::printf(
        "rank %d: over 4 ranks, peak %.2f MiB building, %.2f MiB with one step; full parameters %.2f MiB, "
        "cap %.2f MiB\n",
        rank, build_peak / 1048576.0, step_peak / 1048576.0, full_parameter_bytes(a) / 1048576.0,
        cap_bytes(a) / 1048576.0);
    EXPECT_LT(step_peak, cap_bytes(a));

    // The reference, without a cap: the whole model, the whole global batch, one process.
    torch::manual_seed(kSeed);
    Transformer whole(a);
    torch::optim::SGD ref_opt(whole->parameters(), torch::optim::SGDOptions(0.5));
    loss_and_backward(whole, tokens);
    ref_opt.step();
    expect_parameters_match(model, whole, /*bitwise=*/false);
  });
}

}  // namespace
