// module->to(dtype) and module->to(device) after fully_shard, as FSDP2's FSDPModule._apply and
// reset_sharded_param do: the converted shards are re-laid at the next unshard, training goes on
// in the new dtype like an unsharded model in it, state dicts and checkpoints carry it, a
// MixedPrecisionPolicy applies on top of it, and what cannot be re-laid (a part of one group
// converted, a conversion between forward and backward) is refused by name.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

using fsdp::MixedPrecisionPolicy;
using fsdp::testing::run_distributed;

namespace {

// fc1 and fc2 are FSDP modules of their own, fc3 belongs to the root. Dims 5 -> 7 -> 9 -> 3 do
// not divide 2 or 4, so the shards are uneven and padded.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    torch::manual_seed(11);
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 9));
    fc3 = register_module("fc3", torch::nn::Linear(9, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(fsdp::call(fc1, x));
    h = at::tanh(fsdp::call(fc2, h));
    return fsdp::call(fc3, h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

void shard(Mlp& m, const fsdp::FullyShardOptions& opts) {
  fsdp::fully_shard(m->fc1, opts);
  fsdp::fully_shard(m->fc2, opts);
  fsdp::fully_shard(m, opts);
}

fsdp::DeviceMesh world_mesh() { return fsdp::init_device_mesh("cpu", {fsdp::get_world_size()}); }

constexpr int64_t kRowsPerRank = 3;

// The global batch of a step, the same on every rank, in `dtype`.
at::Tensor global_batch(int64_t step, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return at::randn({kRowsPerRank * fsdp::get_world_size(), 5}, gen).to(dtype);
}

at::Tensor loss_of(Mlp& m, const at::Tensor& x) { return (fsdp::call(m, x) - x.sum(1, true)).pow(2).mean(); }

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.01); }

// `steps` AdamW steps of the FSDP model on this rank's rows and of the unsharded reference on
// the whole batch (the mean of the ranks' equal-sized losses has the reference's gradient).
void train_both(Mlp& model, torch::optim::AdamW& opt, Mlp& ref, torch::optim::AdamW& ref_opt, int64_t first_step,
                int64_t steps, at::ScalarType dtype) {
  const int64_t r = fsdp::get_rank();
  for (int64_t step = first_step; step < first_step + steps; ++step) {
    const at::Tensor global = global_batch(step, dtype);
    opt.zero_grad();
    ref_opt.zero_grad();
    loss_of(model, global.slice(0, kRowsPerRank * r, kRowsPerRank * (r + 1))).backward();
    loss_of(ref, global).backward();
    opt.step();
    ref_opt.step();
  }
}

// Every registered shard, its gradient and its gathered whole have `dtype`, and the whole is
// the reference's parameter within `tolerance`. Collective.
void expect_follows_reference(Mlp& model, Mlp& ref, at::ScalarType dtype, double tolerance) {
  auto ref_params = ref->named_parameters();
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& shard = item.value();
    EXPECT_EQ(shard.scalar_type(), dtype) << item.key();
    ASSERT_TRUE(shard.grad().defined()) << item.key();
    EXPECT_EQ(shard.grad().scalar_type(), dtype) << item.key();
    const at::Tensor full = fsdp::as_dtensor(shard).full_tensor();
    ASSERT_EQ(full.scalar_type(), dtype) << item.key();
    EXPECT_LT((full - ref_params[item.key()]).abs().max().item<double>(), tolerance) << item.key();
  }
}

// Runs `f`, which must throw a c10::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << parts.front() << "'";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
  }
}

}  // namespace

// The optimizer is made before the conversion: LibTorch's Module::to converts the registered
// shards in place, so it keeps stepping the tensors FSDP gathers. The conversion back to fp32
// comes after training, where FSDP2 (2.15) fails at the next all-gather; fsdp-cpp re-lays the
// shards whenever they were converted. One rank covers the shards that alias the parameters.
TEST(ToDtype, AfterFullyShardTrainsLikeAnUnshardedModelInTheNewDtypeAndBack) {
  for (int world : {1, 2, 4}) {
    run_distributed(world, [] {
      Mlp model, ref;
      shard(model, fsdp::FullyShardOptions().mesh(world_mesh()));
      torch::optim::AdamW opt(model->parameters(), adamw()), ref_opt(ref->parameters(), adamw());
      model->to(at::kDouble);
      ref->to(at::kDouble);
      for (const auto& item : fsdp::sharded_state_dict(*model)) {
        EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key() << ": converted before any forward";
      }
      train_both(model, opt, ref, ref_opt, 0, 5, at::kDouble);
      expect_follows_reference(model, ref, at::kDouble, 1e-12);
      for (const auto& item : fsdp::sharded_state_dict(*model)) {
        EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key();
        EXPECT_EQ(item.value().to_local().scalar_type(), at::kDouble) << item.key();
      }

      model->to(at::kFloat);
      ref->to(at::kFloat);
      train_both(model, opt, ref, ref_opt, 5, 5, at::kFloat);
      expect_follows_reference(model, ref, at::kFloat, 1e-5);
      for (const auto& item : fsdp::sharded_state_dict(*model)) {
        EXPECT_EQ(item.value().scalar_type(), at::kFloat) << item.key();
      }
    });
  }
}

// The other layouts convert alike: HSDP (a replicate group all-reduces the reduce-scattered
// gradients) and reshard_after_forward = 2 (a post-forward shard among 2 of 4 ranks), converted
// after two fp32 steps.
TEST(ToDtype, HsdpAndAPostForwardShardConvertAfterTraining) {
  for (bool hsdp : {true, false}) {
    run_distributed(4, [hsdp] {
      auto opts = fsdp::FullyShardOptions();
      if (hsdp) {
        opts.mesh(fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"}));
      } else {
        opts.mesh(world_mesh()).reshard_after_forward(2);
      }
      Mlp model, ref;
      shard(model, opts);
      torch::optim::AdamW opt(model->parameters(), adamw()), ref_opt(ref->parameters(), adamw());
      train_both(model, opt, ref, ref_opt, 0, 2, at::kFloat);
      model->to(at::kDouble);
      ref->to(at::kDouble);
      train_both(model, opt, ref, ref_opt, 2, 3, at::kDouble);
      expect_follows_reference(model, ref, at::kDouble, 1e-5);
    });
  }
}

// A checkpoint written after the conversion holds the new dtype and loads into a model
// converted the same way, before its first forward (the shards are re-laid there).
TEST(ToDtype, ACheckpointSavedAfterTheConversionLoads) {
  const std::string dir = fsdp::testing::shared_temp_path("to_dtype_checkpoint");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
  for (int world : {2, 4}) {
    run_distributed(world, [&] {
      const std::string step_dir = dir + "/w" + std::to_string(fsdp::get_world_size());
      const auto opts = fsdp::FullyShardOptions().mesh(world_mesh());
      Mlp model, ref;
      shard(model, opts);
      model->to(at::kDouble);
      ref->to(at::kDouble);
      torch::optim::AdamW opt(model->parameters(), adamw()), ref_opt(ref->parameters(), adamw());
      train_both(model, opt, ref, ref_opt, 0, 2, at::kDouble);
      fsdp::save_checkpoint(step_dir, fsdp::sharded_state_dict(*model));

      Mlp restored;  // the initial weights, until the checkpoint of 2 steps later is loaded
      shard(restored, opts);
      restored->to(at::kDouble);
      const fsdp::ShardedStateDict loaded = fsdp::load_checkpoint(step_dir, fsdp::sharded_state_dict(*restored));
      for (const auto& item : loaded) EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key();
      fsdp::load_sharded_state_dict(*restored, loaded);
      auto restored_params = restored->named_parameters();
      for (const auto& item : model->named_parameters()) {
        EXPECT_TRUE(fsdp::as_dtensor(restored_params[item.key()])
                        .full_tensor()
                        .equal(fsdp::as_dtensor(item.value()).full_tensor()))
            << item.key();
      }
      const at::Tensor x = global_batch(7, at::kDouble);
      at::NoGradGuard no_grad;
      EXPECT_TRUE(fsdp::call(restored, x).equal(fsdp::call(model, x))) << "the same forward after loading";
    });
  }
}

// FSDP2 resolves the policy against the parameters' dtype: after to(kDouble) a param_dtype of
// fp32 is a cast (fp32 all-gathers, compute and reduce-scatters; fp64 shards, gradients and
// optimizer), bitwise what the same policy does on a model built in fp64; and a param_dtype of
// fp64, a cast while the parameters were fp32, is none any more.
TEST(ToDtype, MixedPrecisionParamDtypeAppliesOnTopOfTheNewDtype) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      const int64_t r = fsdp::get_rank();
      const auto fp32_compute =
          fsdp::FullyShardOptions().mesh(world_mesh()).mp_policy(MixedPrecisionPolicy().param_dtype(at::kFloat));
      Mlp converted, built_in_fp64;
      shard(converted, fp32_compute);
      converted->to(at::kDouble);
      built_in_fp64->to(at::kDouble);
      shard(built_in_fp64, fp32_compute);
      torch::optim::AdamW a(converted->parameters(), adamw()), b(built_in_fp64->parameters(), adamw());
      for (int64_t step = 0; step < 5; ++step) {
        const at::Tensor local = global_batch(step, at::kDouble).slice(0, kRowsPerRank * r, kRowsPerRank * (r + 1));
        a.zero_grad();
        b.zero_grad();
        loss_of(converted, local).backward();
        loss_of(built_in_fp64, local).backward();
        a.step();
        b.step();
      }
      auto expected = built_in_fp64->named_parameters();
      for (const auto& item : converted->named_parameters()) {
        EXPECT_EQ(item.value().scalar_type(), at::kDouble) << item.key();
        EXPECT_EQ(item.value().grad().scalar_type(), at::kDouble) << item.key();
        EXPECT_TRUE(
            fsdp::as_dtensor(item.value()).full_tensor().equal(fsdp::as_dtensor(expected[item.key()]).full_tensor()))
            << item.key();
      }
      {
        at::NoGradGuard no_grad;
        EXPECT_EQ(fsdp::call(converted, global_batch(5, at::kDouble)).scalar_type(), at::kFloat)
            << "computed in param_dtype";
      }
      fsdp::FSDPModule fc1 = fsdp::get_fsdp_module(*converted->fc1);
      fc1.unshard();
      EXPECT_EQ(converted->fc1->weight.scalar_type(), at::kFloat) << "the unsharded face computes in param_dtype";
      fc1.reshard();

      Mlp fp64_compute;  // param_dtype fp64 on fp32 parameters: a cast, until they are fp64 too
      shard(fp64_compute,
            fsdp::FullyShardOptions().mesh(world_mesh()).mp_policy(MixedPrecisionPolicy().param_dtype(at::kDouble)));
      fsdp::FSDPModule f = fsdp::get_fsdp_module(*fp64_compute->fc1);
      f.unshard();
      EXPECT_EQ(fp64_compute->fc1->weight.scalar_type(), at::kDouble);
      f.reshard();
      fp64_compute->to(at::kDouble);
      const at::Tensor x = global_batch(0, at::kDouble).slice(0, kRowsPerRank * r, kRowsPerRank * (r + 1));
      loss_of(fp64_compute, x).backward();
      for (const auto& item : fp64_compute->named_parameters()) {
        EXPECT_EQ(item.value().grad().scalar_type(), at::kDouble) << item.key();
      }
    });
  }
}

// to(kCPU) on a CPU mesh converts nothing: the shards stay FSDP's views, and training goes on.
// Device and dtype in one call convert. (A CPU build has no second device to move the shards
// to: set_data refuses other device types; tests/cuda moves them between the GPU and the host.)
TEST(ToDtype, ToTheMeshsDeviceKeepsTheShardsAndWithADtypeConverts) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      Mlp model, ref;
      shard(model, fsdp::FullyShardOptions().mesh(world_mesh()));
      std::vector<const void*> before;
      for (const auto& p : model->parameters()) before.push_back(p.data_ptr());
      model->to(torch::kCPU);
      ref->to(torch::kCPU);
      const auto after = model->parameters();
      for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i].data_ptr(), before[i]) << "parameter " << i;
      torch::optim::AdamW opt(model->parameters(), adamw()), ref_opt(ref->parameters(), adamw());
      train_both(model, opt, ref, ref_opt, 0, 2, at::kFloat);
      expect_follows_reference(model, ref, at::kFloat, 1e-5);
      model->to(torch::kCPU, at::kDouble);
      ref->to(torch::kCPU, at::kDouble);
      train_both(model, opt, ref, ref_opt, 2, 3, at::kDouble);
      expect_follows_reference(model, ref, at::kDouble, 1e-5);
    });
  }
}

// FSDP2 asserts "FSDP expects uniform original parameter dtype" when a part of one group is
// converted; a group is gathered in one all-gather, so it is refused before anything is issued,
// naming the parameters and their dtypes. Converting a child that is an FSDP module of its own
// converts its whole group.
TEST(ToDtype, APartOfOneGroupConvertedIsRefusedAndAWholeChildGroupIsNot) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      Mlp one_group;
      fsdp::fully_shard(one_group, fsdp::FullyShardOptions().mesh(world_mesh()));
      one_group->fc2->to(at::kDouble);
      expect_error([&] { loss_of(one_group, global_batch(0, at::kFloat)); },
                   {"FSDP expects one dtype for the parameters of FSDP module '(root)'", "'fc1.weight' (Float)",
                    "'fc2.weight' (Double)", "Convert the whole FSDP module"});

      Mlp model;
      shard(model, fsdp::FullyShardOptions().mesh(world_mesh()));
      model->fc2->to(at::kDouble);  // an FSDP module: its group is converted whole
      fsdp::FSDPModule fc2 = fsdp::get_fsdp_module(*model->fc2);
      fc2.unshard();
      EXPECT_EQ(model->fc2->weight.scalar_type(), at::kDouble);
      const at::Tensor x = at::randn({2, 7}, at::kDouble);
      EXPECT_TRUE(model->fc2->forward(x).allclose(
          at::linear(x, fsdp::as_dtensor(model->fc2->named_parameters()["weight"]).full_tensor(),
                     fsdp::as_dtensor(model->fc2->named_parameters()["bias"]).full_tensor())));
      fc2.reshard();
    });
  }
}

// The backward needs the parameters its forward computed with: a conversion in between is
// refused at the first module whose backward meets it, before any collective.
TEST(ToDtype, AConversionBetweenForwardAndBackwardIsRefused) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      Mlp model;
      shard(model, fsdp::FullyShardOptions().mesh(world_mesh()));
      const at::Tensor loss = loss_of(model, global_batch(0, at::kFloat));
      model->to(at::kDouble);
      expect_error([&] { loss.backward(); }, {"were converted (module->to() or set_data()) between its forward and "
                                              "its backward",
                                              "Convert between iterations"});
    });
  }
}
