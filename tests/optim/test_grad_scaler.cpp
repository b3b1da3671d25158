// fsdp::GradScaler: the scale arithmetic, growth and backoff, the stage and option errors, a
// disabled scaler and dtype-agnostic unscaling in this process (no process group: the plain,
// single-process use); an inf or nan on one rank of a fully_shard'ed model skipping the step on
// every rank, with one all-reduce per unscale_; and the state through a checkpoint.
#include "harness/multiprocess.h"
#include "test_models.h"

#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include "src/util/compat.h"
#include <fsdp/distributed.h>
#include <fsdp/grad_scaler.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

using fsdp::CollectiveKind;
using fsdp::GradScaler;
using fsdp::GradScalerOptions;
using fsdp::testing::run_distributed;

namespace {

// Runs fn and expects a c10::Error whose message contains `text`.
void expect_error(const std::function<void()>& fn, const std::string& text) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << text;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << "got: " << e.what();
  }
}

// A leaf parameter of grad's shape and dtype whose gradient is `grad` (as backward would leave it).
at::Tensor param_with_grad(const at::Tensor& grad) {
  at::Tensor p = at::zeros(grad.sizes(), grad.options()).requires_grad_();
  p.mutable_grad() = grad;
  return p;
}

torch::optim::SGD sgd(const std::vector<at::Tensor>& params, double lr = 1.0) {
  return torch::optim::SGD(params, torch::optim::SGDOptions(lr));
}

// scaler.scale() on a stand-in loss: what marks the start of an iteration for the scaler.
void mark_scaled(GradScaler& scaler) { scaler.scale(at::ones({})); }

at::Tensor tokens(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step + 1000 * fsdp::get_rank());
  return at::randint(0, 8, {2, 16}, gen);
}

at::Tensor loss_of(fsdp::testing::WithBuffer& model, const at::Tensor& toks) {
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
}

// Copies of every parameter shard and of Adam's state for it, in parameter order.
std::vector<at::Tensor> training_state(torch::nn::Module& model, torch::optim::Adam& opt) {
  std::vector<at::Tensor> out;
  for (const auto& p : model.parameters()) {
    out.push_back(p.detach().clone());
    auto it = opt.state().find(fsdp::compat::optimizer_state_key(opt.state(), p.unsafeGetTensorImpl()));
    if (it == opt.state().end()) continue;
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
    out.push_back(at::scalar_tensor(static_cast<double>(s.step())));
  }
  return out;
}

void expect_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << ", tensor " << i;
}

// Puts `value` into the first element of this rank's first non-empty gradient shard.
void poison_one_gradient(torch::nn::Module& model, float value) {
  for (const auto& p : model.parameters()) {
    if (p.grad().defined() && p.grad().numel() > 0) {
      p.grad().view({-1})[0].fill_(value);
      return;
    }
  }
  FAIL() << "this rank holds no gradient to poison";
}

}  // namespace

TEST(GradScaler, ScalesTheLossAndUnscalesGradientsExactly) {
  torch::manual_seed(0);
  torch::nn::Linear linear(4, 3);  // a plain module: no fully_shard, no process group
  const at::Tensor x = at::randn({5, 4});
  linear->forward(x).pow(2).sum().backward();
  std::vector<at::Tensor> reference;
  for (const auto& p : linear->parameters()) reference.push_back(p.grad().clone());
  linear->zero_grad();

  auto opt = sgd(linear->parameters(), 0.0);
  GradScaler scaler(GradScalerOptions().init_scale(1024));
  const at::Tensor loss = linear->forward(x).pow(2).sum();
  const at::Tensor scaled = scaler.scale(loss);
  EXPECT_EQ(scaled.item<double>(), loss.item<double>() * 1024);  // a power of 2 scales exactly
  scaled.backward();
  for (size_t i = 0; i < reference.size(); ++i)
    EXPECT_TRUE(at::equal(linear->parameters()[i].grad(), reference[i] * 1024));
  scaler.unscale_(opt);
  for (size_t i = 0; i < reference.size(); ++i) EXPECT_TRUE(at::equal(linear->parameters()[i].grad(), reference[i]));
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1024);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);

  // The scaled loss keeps the loss's dtype and shape (bf16 stays bf16, as with ShardedGradScaler).
  const at::Tensor bf16 = scaler.scale(at::full({}, 0.5, at::kBFloat16));
  EXPECT_EQ(bf16.scalar_type(), at::kBFloat16);
  EXPECT_EQ(bf16.dim(), 0);
  EXPECT_EQ(bf16.item<double>(), 512);
}

TEST(GradScaler, GrowsAfterTheIntervalAndBacksOffOnInfOrNan) {
  GradScaler scaler(GradScalerOptions().init_scale(8).growth_interval(3));
  at::Tensor p = param_with_grad(at::zeros({2}));
  auto opt = sgd({p});
  // One iteration whose scaled gradient is `scaled_grad`; returns whether it stepped.
  auto iteration = [&](float scaled_grad) {
    mark_scaled(scaler);
    p.mutable_grad() = at::full({2}, scaled_grad);
    const bool stepped = scaler.step(opt);
    scaler.update();
    return stepped;
  };
  for (int64_t i = 1; i <= 3; ++i) {
    const double scale = scaler.get_scale();
    EXPECT_TRUE(iteration(static_cast<float>(scale)));  // true gradient 1: p drops by lr * 1
    EXPECT_EQ(p[0].item<float>(), -static_cast<float>(i));
    EXPECT_EQ(scaler.get_growth_tracker(), i % 3);
  }
  EXPECT_EQ(scaler.get_scale(), 16) << "grows by growth_factor after growth_interval clean steps";
  for (float bad : {INFINITY, NAN, -INFINITY}) {
    const double scale = scaler.get_scale();
    EXPECT_FALSE(iteration(bad)) << bad;
    EXPECT_EQ(p[0].item<float>(), -3.0f) << "a skipped step leaves the parameter alone";
    EXPECT_EQ(scaler.get_scale(), scale * 0.5) << bad;
    EXPECT_EQ(scaler.get_growth_tracker(), 0);
  }
  EXPECT_TRUE(iteration(2.0f));
  EXPECT_EQ(scaler.get_growth_tracker(), 1);

  // new_scale sets the scale and leaves the tracker; a lowered interval grows at the next step.
  mark_scaled(scaler);
  scaler.update(100.0);
  EXPECT_EQ(scaler.get_scale(), 100);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
  scaler.set_growth_interval(1);
  EXPECT_TRUE(iteration(1.0f));
  EXPECT_EQ(scaler.get_scale(), 200);

  // Growth that would overflow fp32 keeps the scale.
  GradScaler huge(GradScalerOptions().init_scale(std::ldexp(1.0, 127)).growth_interval(1));
  mark_scaled(huge);
  p.mutable_grad() = at::ones({2});
  EXPECT_TRUE(huge.step(opt));
  huge.update();
  EXPECT_EQ(huge.get_scale(), std::ldexp(1.0, 127));
  EXPECT_EQ(huge.get_growth_tracker(), 0);
}

TEST(GradScaler, UnscalesAndChecksEveryFloatingDtype) {
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    GradScaler scaler(GradScalerOptions().init_scale(1024));
    const at::Tensor truth = at::tensor({1.0, -2.0, 0.5, 3.0}).to(dtype);
    at::Tensor small = param_with_grad(truth * 1024);
    at::Tensor transposed = param_with_grad((truth.reshape({2, 2}) * 1024).t());  // non-contiguous
    at::Tensor large = param_with_grad(at::full({200000}, 1024.0, dtype));        // several tasks
    at::Tensor without_grad = at::zeros({3}, dtype).requires_grad_();             // skipped
    auto opt = sgd({small, transposed, large, without_grad}, 0.0);
    mark_scaled(scaler);
    scaler.unscale_(opt);
    EXPECT_TRUE(at::equal(small.grad(), truth));
    EXPECT_TRUE(at::equal(transposed.grad(), truth.reshape({2, 2}).t()));
    EXPECT_TRUE(at::equal(large.grad(), at::ones({200000}, dtype)));
    EXPECT_TRUE(scaler.step(opt));
    scaler.update();

    large.grad()[199999].fill_(INFINITY);  // the last element of the last task
    mark_scaled(scaler);
    EXPECT_FALSE(scaler.step(opt));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512);
  }
}

TEST(GradScaler, StageErrors) {
  at::Tensor p = param_with_grad(at::ones({2}));
  auto opt = sgd({p}, 0.0);
  GradScaler scaler;
  expect_error([&] { scaler.unscale_(opt); }, "before any scale()");
  expect_error([&] { scaler.step(opt); }, "before any scale()");
  expect_error([&] { scaler.update(); }, "before any scale()");
  mark_scaled(scaler);
  expect_error([&] { scaler.update(); }, "no inf checks were recorded prior to update()");
  scaler.unscale_(opt);
  expect_error([&] { scaler.unscale_(opt); },
               "unscale_() has already been called on this optimizer since the last update()");
  EXPECT_TRUE(scaler.step(opt));
  expect_error([&] { scaler.unscale_(opt); }, "unscale_() is being called after step()");
  expect_error([&] { scaler.step(opt); }, "step() has already been called since the last update()");
  // Stages are per optimizer: another one is still ready in this iteration.
  at::Tensor q = param_with_grad(at::ones({2}));
  auto other = sgd({q}, 0.0);
  scaler.unscale_(other);
  scaler.update();
  scaler.unscale_(opt);  // a new iteration

  at::Tensor without_grad = at::zeros({2}).requires_grad_();
  auto empty = sgd({without_grad});
  GradScaler fresh;
  mark_scaled(fresh);
  expect_error([&] { fresh.step(empty); }, "no inf checks were recorded for this optimizer");
  expect_error([&] { fresh.update(); }, "no inf checks were recorded prior to update()");
}

TEST(GradScaler, OptionErrors) {
  expect_error([] { GradScaler s(GradScalerOptions().growth_factor(1.0)); }, "growth_factor must be > 1.0");
  expect_error([] { GradScaler s(GradScalerOptions().backoff_factor(1.0)); }, "backoff_factor must be in (0, 1)");
  expect_error([] { GradScaler s(GradScalerOptions().backoff_factor(0.0)); }, "backoff_factor must be in (0, 1)");
  expect_error([] { GradScaler s(GradScalerOptions().growth_interval(0)); }, "growth_interval must be > 0");
  expect_error([] { GradScaler s(GradScalerOptions().init_scale(0)); }, "init_scale must be positive and finite");
  expect_error([] { GradScaler s(GradScalerOptions().init_scale(1e39)); }, "init_scale must be positive and finite");
  GradScaler unchecked(GradScalerOptions().enabled(false).growth_factor(0.5));  // disabled: not checked
  GradScaler scaler;
  expect_error([&] { scaler.set_growth_factor(0.9); }, "growth_factor must be > 1.0");
  expect_error([&] { scaler.set_backoff_factor(2); }, "backoff_factor must be in (0, 1)");
  expect_error([&] { scaler.set_growth_interval(-1); }, "growth_interval must be > 0");
  mark_scaled(scaler);
  expect_error([&] { scaler.update(-1.0); }, "new_scale must be positive and finite");
  expect_error([&] { scaler.scale(at::ones({}, at::kLong)); }, "the loss must be a defined floating-point tensor");
}

TEST(GradScaler, DisabledIsTheIdentityAndStateDictRoundTrips) {
  GradScaler disabled(GradScalerOptions().enabled(false));
  EXPECT_FALSE(disabled.is_enabled());
  const at::Tensor loss = at::full({}, 3.0);
  EXPECT_TRUE(disabled.scale(loss).is_same(loss));
  at::Tensor p = param_with_grad(at::full({2}, INFINITY));
  auto opt = sgd({p});
  disabled.unscale_(opt);
  EXPECT_TRUE(at::equal(p.grad(), at::full({2}, INFINITY)));
  EXPECT_TRUE(disabled.step(opt)) << "a disabled scaler always steps";
  EXPECT_TRUE(std::isinf(p[0].item<float>()));
  disabled.update();
  EXPECT_EQ(disabled.get_scale(), 1.0);
  EXPECT_EQ(disabled.get_growth_tracker(), 0);
  EXPECT_TRUE(disabled.state_dict().empty());
  EXPECT_EQ(disabled.sharded_state_dict(fsdp::DeviceMesh()).size(), 0u);
  disabled.load_state_dict({});

  GradScaler scaler(GradScalerOptions().init_scale(256).growth_interval(5));
  expect_error([&] { scaler.load_state_dict(disabled.state_dict()); },
               "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.");
  expect_error([&] { scaler.load_sharded_state_dict(fsdp::ShardedStateDict()); }, "The source state dict is empty");
  fsdp::GradScalerState state = {
      {"scale", 32}, {"growth_factor", 3}, {"backoff_factor", 0.25}, {"growth_interval", 9}, {"_growth_tracker", 4}};
  scaler.load_state_dict(state);
  EXPECT_EQ(scaler.state_dict(), state);
  EXPECT_EQ(scaler.get_growth_factor(), 3);
  state.erase("_growth_tracker");
  expect_error([&] { scaler.load_state_dict(state); }, "no '_growth_tracker' entry");
  state["_growth_tracker"] = 1.5;
  expect_error([&] { scaler.load_state_dict(state); }, "'_growth_tracker' must be a non-negative whole number");
}

// Every rank skips the step when any rank's shard has an inf or nan; clean steps train exactly
// as without the scaler; each unscale_ is one all-reduce.
TEST(GradScaler, InfOrNanOnOneRankSkipsTheStepOnEveryRank) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto model = fsdp::testing::make_sharded(1);
      auto plain = fsdp::testing::make_sharded(1);  // the same training without the scaler
      torch::optim::Adam opt(model->parameters(), 1e-2), plain_opt(plain->parameters(), 1e-2);
      // W = 2 names the shard group; W = 4 relies on the default, the world.
      auto shard_group = fsdp::as_dtensor(model->parameters()[0]).device_mesh().get_group(0);
      auto group = W == 2 ? shard_group : fsdp::world();
      GradScaler scaler(GradScalerOptions().init_scale(1024).process_group(W == 2 ? shard_group : nullptr));
      struct Iteration {
        int poisoned_rank;  // -1: a clean step
        float value;
      };
      const std::vector<Iteration> iterations = {{-1, 0}, {W - 1, INFINITY}, {0, NAN}, {-1, 0}};
      double expected_scale = 1024;
      for (size_t it = 0; it < iterations.size(); ++it) {
        SCOPED_TRACE("iteration " + std::to_string(it));
        const bool clean = iterations[it].poisoned_rank < 0;
        const at::Tensor toks = tokens(static_cast<int64_t>(it));
        opt.zero_grad();
        scaler.scale(loss_of(model, toks)).backward();
        if (r == iterations[it].poisoned_rank) poison_one_gradient(*model, iterations[it].value);
        const auto before = training_state(*model, opt);
        group->reset_stats();
        if (it + 1 < iterations.size()) {  // the last iteration lets step() unscale
          scaler.unscale_(opt);
          EXPECT_EQ(group->stats()[CollectiveKind::kAllReduce].calls, 1);
          EXPECT_EQ(group->stats().total_calls(), 1);
          fsdp::clip_grad_norm_(model->parameters(), 1e9);  // the documented loop; clips nothing here
          group->reset_stats();
        }
        const bool stepped = scaler.step(opt);
        EXPECT_EQ(group->stats().total_calls(), it + 1 < iterations.size() ? 0 : 1);
        EXPECT_EQ(group->stats()[CollectiveKind::kAllReduce].calls, it + 1 < iterations.size() ? 0 : 1);
        scaler.update();
        EXPECT_EQ(stepped, clean);
        if (!clean) {
          expect_same(training_state(*model, opt), before, "a skipped step changes nothing");
          expected_scale *= 0.5;
        } else {
          plain_opt.zero_grad();
          loss_of(plain, toks).backward();
          plain_opt.step();
          auto plain_params = plain->named_parameters();
          for (const auto& item : model->named_parameters())
            EXPECT_LT((item.value() - plain_params[item.key()]).abs().max().item<double>(), 1e-6) << item.key();
        }
        EXPECT_EQ(scaler.get_scale(), expected_scale);
        EXPECT_EQ(scaler.get_growth_tracker(), clean ? 1 : 0);
      }
    });
  }
}

TEST(GradScaler, StateSurvivesACheckpointAtAnotherWorldSize) {
  const std::string dir = fsdp::testing::shared_temp_path("grad_scaler_ckpt");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
  const fsdp::GradScalerState saved = {
      {"scale", 2048}, {"growth_factor", 4}, {"backoff_factor", 0.25}, {"growth_interval", 7}, {"_growth_tracker", 3}};
  // The checkpoint as a trainer would write it: the model's shards plus the scaler's entries.
  auto checkpoint_state = [](torch::nn::Module& model, const GradScaler& scaler) {
    auto mesh = fsdp::as_dtensor(model.parameters()[0]).device_mesh();
    fsdp::ShardedStateDict sd = fsdp::sharded_state_dict(model);
    for (const auto& item : scaler.sharded_state_dict(mesh)) sd.insert(item.key(), item.value());
    return sd;
  };
  run_distributed(2, [&] {
    auto model = fsdp::testing::make_sharded(1);
    GradScaler scaler;
    scaler.load_state_dict(saved);
    fsdp::save_checkpoint(dir, checkpoint_state(*model, scaler));
  });
  for (int world : {2, 3}) {
    run_distributed(world, [&] {
      auto model = fsdp::testing::make_sharded(1);
      GradScaler scaler;  // defaults: everything must come from the checkpoint
      scaler.load_sharded_state_dict(fsdp::load_checkpoint(dir, checkpoint_state(*model, scaler)));
      EXPECT_EQ(scaler.state_dict(), saved);
    });
  }
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
}
