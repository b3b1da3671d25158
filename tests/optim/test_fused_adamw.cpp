// FusedAdamW against torch::optim::AdamW: the same trajectory on a plain module and on a
// fully_shard'ed Transformer (real processes, W = 1, 2 and 3), with weight decay, amsgrad, a
// parameter without a gradient on some steps and the lr changed between steps; state that one
// writes (sharded optimizer state dict, checkpoint, torch::save) loads into the other; and the
// fused runs that a step makes. DeviceStateAdamW against AdamW on its CPU stand-in.
#include "harness/multiprocess.h"
#include "test_models.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include "src/util/compat.h"
#include <fsdp/device_state_adamw.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/fused_adamw.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using fsdp::optim::FusedAdamW;
using fsdp::testing::run_distributed;
using torch::optim::AdamW;
using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

namespace {

constexpr double kTolerance = 1e-6;

fsdp::models::Transformer plain_transformer(uint64_t seed) {
  torch::manual_seed(seed);
  fsdp::models::ModelArgs args;
  args.dropout_p = 0.0;
  return fsdp::models::Transformer(args);
}

// Rank-dependent tokens, the same for both models of a comparison.
at::Tensor tokens_for(int64_t step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step + 1000 * rank);
  return at::randint(0, 8, {2, 16}, gen);
}

template <typename Model>
at::Tensor forward_backward(Model& model, const at::Tensor& toks) {
  at::Tensor logits = fsdp::call(model, toks);
  at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
  loss.backward();
  return loss.detach();
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// What the trajectory tests do between backward and step: the wq weights have no gradient on
// steps 0 and 5 (so their state is created a step late, outside the first step's flat buffer),
// the norm biases none on step 7, and the lr drops to 0.3x from step 10.
void perturb_step(torch::nn::Module& model, torch::optim::Optimizer& opt, int64_t step, double base_lr) {
  for (auto& item : model.named_parameters()) {
    const bool drop = ((step == 0 || step == 5) && ends_with(item.key(), "attention.wq.weight")) ||
                      (step == 7 && ends_with(item.key(), "norm.bias"));
    if (drop) item.value().mutable_grad().reset();
  }
  for (auto& group : opt.param_groups()) {
    static_cast<AdamWOptions&>(group.options()).lr(step < 10 ? base_lr : 0.3 * base_lr);
  }
}

int64_t params_with_grad(torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.grad().defined() ? 1 : 0;
  return n;
}

// Every (local) parameter of `a` within kTolerance of the same one of `b`.
void expect_params_near(torch::nn::Module& a, torch::nn::Module& b, const std::string& where) {
  auto b_params = b.named_parameters();
  for (const auto& item : a.named_parameters()) {
    if (item.value().numel() == 0) continue;  // a rank without rows of this parameter
    const double diff = (item.value() - b_params[item.key()]).abs().max().item<double>();
    EXPECT_LT(diff, kTolerance) << where << ": " << item.key();
  }
}

AdamWParamState& state_of(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto& states = opt.state();
  return static_cast<AdamWParamState&>(*states.at(fsdp::compat::optimizer_state_key(states, p.unsafeGetTensorImpl())));
}

void expect_states_near(torch::nn::Module& a, torch::optim::Optimizer& opt_a, torch::nn::Module& b,
                        torch::optim::Optimizer& opt_b) {
  auto b_params = b.named_parameters();
  for (const auto& item : a.named_parameters()) {
    AdamWParamState& sa = state_of(opt_a, item.value());
    AdamWParamState& sb = state_of(opt_b, b_params[item.key()]);
    EXPECT_EQ(sa.step(), sb.step()) << item.key();
    if (item.value().numel() == 0) continue;
    EXPECT_LT((sa.exp_avg() - sb.exp_avg()).abs().max().item<double>(), kTolerance) << item.key();
    EXPECT_LT((sa.exp_avg_sq() - sb.exp_avg_sq()).abs().max().item<double>(), kTolerance) << item.key();
    ASSERT_EQ(sa.max_exp_avg_sq().defined(), sb.max_exp_avg_sq().defined()) << item.key();
    if (sa.max_exp_avg_sq().defined()) {
      EXPECT_LT((sa.max_exp_avg_sq() - sb.max_exp_avg_sq()).abs().max().item<double>(), kTolerance) << item.key();
    }
  }
}

std::vector<AdamWOptions> option_sets() {
  return {AdamWOptions(1e-2),  // AdamW's default weight decay, 0.01
          AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true),
          AdamWOptions(3e-3).weight_decay(0.0).betas(std::make_tuple(0.8, 0.95)).eps(1e-6)};
}

// 20 steps of `opt` on `model` and AdamW on `reference` (equal models), compared after each.
// `after_step` is called after each of opt's steps.
template <typename Model>
void train_against_adamw(
    torch::optim::Optimizer& opt, Model& model, Model& reference, const AdamWOptions& options, int rank,
    const std::function<void()>& after_step = [] {}) {
  AdamW reference_opt(reference->parameters(), options);
  for (int64_t step = 0; step < 20; ++step) {
    const at::Tensor toks = tokens_for(step, rank);
    opt.zero_grad();
    reference_opt.zero_grad();
    forward_backward(model, toks);
    forward_backward(reference, toks);
    perturb_step(*model, opt, step, options.lr());
    perturb_step(*reference, reference_opt, step, options.lr());
    EXPECT_EQ(params_with_grad(*model), params_with_grad(*reference));
    opt.step();
    reference_opt.step();
    after_step();
    expect_params_near(*model, *reference, "step " + std::to_string(step));
  }
  expect_states_near(*model, opt, *reference, reference_opt);
}

// The same for FusedAdamW; returns its stats of every step.
template <typename Model>
std::vector<fsdp::optim::FusedAdamWStepStats> train_side_by_side(Model& fused, Model& reference,
                                                                 const AdamWOptions& options, int rank) {
  FusedAdamW fused_opt(fused->parameters(), options);
  std::vector<fsdp::optim::FusedAdamWStepStats> stats;
  train_against_adamw(fused_opt, fused, reference, options, rank,
                      [&] { stats.push_back(fused_opt.last_step_stats()); });
  return stats;
}

}  // namespace

TEST(FusedAdamW, MatchesAdamWOnAPlainModule) {
  for (const AdamWOptions& options : option_sets()) {
    auto fused = plain_transformer(3);
    auto reference = plain_transformer(3);
    const int64_t n_params = static_cast<int64_t>(fused->parameters().size());
    const auto stats = train_side_by_side(fused, reference, options, 0);
    // Separate tensors: every parameter is a run of its own.
    EXPECT_EQ(stats[1].fused_runs, n_params);
    EXPECT_EQ(stats[1].fused_params, n_params);
    EXPECT_EQ(stats[1].largest_run_params, 1);
    EXPECT_EQ(stats[1].unfused_params, 0);
    EXPECT_EQ(stats[0].fused_params, n_params - 2) << "two wq weights have no gradient on step 0";
  }
}

TEST(FusedAdamW, MatchesAdamWOnAShardedTransformer) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      for (const AdamWOptions& options : option_sets()) {
        auto fused = fsdp::testing::make_sharded(5);
        auto reference = fsdp::testing::make_sharded(5);
        const auto stats = train_side_by_side(fused, reference, options, fsdp::get_rank());
        // One run per fully_shard group (two blocks and the root), whatever lacks a gradient.
        const int64_t n_params = static_cast<int64_t>(fused->parameters().size());
        for (size_t step = 0; step < stats.size(); ++step) {
          EXPECT_EQ(stats[step].fused_runs, 3) << "step " << step;
          EXPECT_EQ(stats[step].unfused_params, 0) << "step " << step;
        }
        EXPECT_EQ(stats[1].fused_params, n_params);
        EXPECT_EQ(stats[1].largest_run_params, 12) << "a block's parameters";
      }
    });
  }
}

TEST(FusedAdamW, StateOfAShardGroupIsOneFlatBuffer) {
  run_distributed(2, [] {
    auto model = fsdp::testing::make_sharded(5);
    FusedAdamW opt(model->parameters(), AdamWOptions(1e-2).amsgrad(true));
    forward_backward(model, tokens_for(0, fsdp::get_rank()));
    opt.step();
    auto params = model->named_parameters();
    const std::vector<std::string> block = {"net.layers.1.attention.wq.weight", "net.layers.1.attention.wo.weight",
                                            "net.layers.1.feed_forward.w2.bias"};
    const AdamWParamState& first = state_of(opt, params[block[0]]);
    for (const std::string& fqn : block) {
      const AdamWParamState& s = state_of(opt, params[fqn]);
      EXPECT_TRUE(s.exp_avg().storage().is_alias_of(first.exp_avg().storage())) << fqn;
      EXPECT_TRUE(s.exp_avg_sq().storage().is_alias_of(first.exp_avg_sq().storage())) << fqn;
      EXPECT_TRUE(s.max_exp_avg_sq().storage().is_alias_of(first.max_exp_avg_sq().storage())) << fqn;
      EXPECT_EQ(s.exp_avg().sizes(), params[fqn].sizes()) << fqn;
    }
    EXPECT_FALSE(state_of(opt, params["net.layers.0.attention.wq.weight"])
                     .exp_avg()
                     .storage()
                     .is_alias_of(first.exp_avg().storage()))
        << "another group's state has its own buffer";
  });
}

TEST(FusedAdamW, UnfusableParametersTakeAdamWsOwnOps) {
  // bf16 (not float or double), a transposed view (not contiguous), and a double parameter
  // (fused), in one group; each compared with AdamW on copies.
  torch::manual_seed(11);
  auto make = [] {
    return std::vector<at::Tensor>{at::randn({4, 3}).to(at::kBFloat16).requires_grad_(),
                                   at::randn({3, 5}).t().requires_grad_(),
                                   at::randn({6}, at::kDouble).requires_grad_()};
  };
  std::vector<at::Tensor> fused_params = make();
  std::vector<at::Tensor> reference_params;
  for (const auto& p : fused_params) reference_params.push_back(p.detach().clone().requires_grad_());
  const auto options = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
  FusedAdamW fused(fused_params, options);
  AdamW reference(reference_params, options);
  for (int step = 0; step < 5; ++step) {
    for (size_t i = 0; i < fused_params.size(); ++i) {
      const at::Tensor g = at::randn(fused_params[i].sizes()).to(fused_params[i].scalar_type());
      fused_params[i].mutable_grad() = g.clone();
      reference_params[i].mutable_grad() = g.clone();
    }
    fused.step();
    reference.step();
    EXPECT_EQ(fused.last_step_stats().unfused_params, 2);
    EXPECT_EQ(fused.last_step_stats().fused_params, 1);
    EXPECT_TRUE(fused_params[0].equal(reference_params[0])) << "bf16, step " << step;
    EXPECT_TRUE(fused_params[1].equal(reference_params[1])) << "strided, step " << step;
    EXPECT_LT((fused_params[2] - reference_params[2]).abs().max().item<double>(), 1e-14) << "double, step " << step;
  }
}

TEST(FusedAdamW, ParameterListedTwiceIsUpdatedTwiceLikeAdamW) {
  torch::manual_seed(12);
  at::Tensor p = at::randn({64}).requires_grad_();
  at::Tensor q = p.detach().clone().requires_grad_();
  FusedAdamW fused(std::vector<at::Tensor>{p, p}, AdamWOptions(1e-2));
  AdamW reference(std::vector<at::Tensor>{q, q}, AdamWOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor g = at::randn({64});
    p.mutable_grad() = g.clone();
    q.mutable_grad() = g.clone();
    fused.step();
    reference.step();
    EXPECT_EQ(fused.last_step_stats().fused_runs, 2);
    EXPECT_LT((p - q).abs().max().item<double>(), kTolerance) << "step " << step;
  }
  EXPECT_EQ(state_of(fused, p).step(), 6);
}

TEST(FusedAdamW, AutogradSeesTheInPlaceUpdate) {
  // As with AdamW's in-place ops, a graph that saved a parameter before the step cannot be
  // differentiated after it.
  at::Tensor p = at::ones({3}).requires_grad_();
  FusedAdamW opt(std::vector<at::Tensor>{p}, AdamWOptions(0.1));
  at::Tensor saved_p = (p * p).sum();
  p.mutable_grad() = at::ones({3});
  opt.step();
  EXPECT_THROW(saved_p.backward(), c10::Error);
}

TEST(FusedAdamW, ClosureIsCalledWithGradModeOn) {
  at::Tensor p = at::ones({3}).requires_grad_();
  FusedAdamW opt(std::vector<at::Tensor>{p}, AdamWOptions(0.1));
  at::Tensor loss = opt.step([&] {
    EXPECT_TRUE(at::GradMode::is_enabled());
    at::Tensor l = (p * p).sum();
    l.backward();
    return l;
  });
  EXPECT_DOUBLE_EQ(loss.item<double>(), 3.0);
  EXPECT_LT(p[0].item<double>(), 1.0);
}

TEST(FusedAdamW, TorchSaveLoadsIntoAdamWAndBack) {
  for (bool fused_writes : {true, false}) {
    auto writer = plain_transformer(4);
    auto reader = plain_transformer(9);
    const auto options = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
    // The same options on both sides: LibTorch 1.13's Optimizer::load restores the state but not
    // the groups' options.
    std::unique_ptr<torch::optim::Optimizer> writer_opt, reader_opt;
    if (fused_writes) {
      writer_opt = std::make_unique<FusedAdamW>(writer->parameters(), options);
      reader_opt = std::make_unique<AdamW>(reader->parameters(), options);
    } else {
      writer_opt = std::make_unique<AdamW>(writer->parameters(), options);
      reader_opt = std::make_unique<FusedAdamW>(reader->parameters(), options);
    }
    for (int64_t step = 0; step < 3; ++step) {
      writer_opt->zero_grad();
      forward_backward(writer, tokens_for(step, 0));
      writer_opt->step();
    }
    std::stringstream saved;
    torch::save(*writer_opt, saved);
    {
      torch::NoGradGuard no_grad;
      auto reader_params = reader->named_parameters();
      for (const auto& item : writer->named_parameters()) reader_params[item.key()].copy_(item.value());
    }
    torch::load(*reader_opt, saved);
    for (int64_t step = 3; step < 8; ++step) {
      for (auto* side : {&writer, &reader}) {
        auto& opt = side == &writer ? writer_opt : reader_opt;
        opt->zero_grad();
        forward_backward(*side, tokens_for(step, 0));
        opt->step();
      }
      expect_params_near(*writer, *reader,
                         (fused_writes ? "fused wrote, step " : "AdamW wrote, step ") + std::to_string(step));
    }
    expect_states_near(*writer, *writer_opt, *reader, *reader_opt);
  }
}

TEST(FusedAdamW, ShardedOptimizerStateDictLoadsIntoAdamWAndBack) {
  run_distributed(2, [] {
    for (bool fused_writes : {true, false}) {
      const auto options = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
      auto writer = fsdp::testing::make_sharded(1);
      auto reader = fsdp::testing::make_sharded(7);  // other weights: everything comes from the state dicts
      std::unique_ptr<torch::optim::Optimizer> writer_opt, reader_opt;
      if (fused_writes) {
        writer_opt = std::make_unique<FusedAdamW>(writer->parameters(), options);
        reader_opt = std::make_unique<AdamW>(reader->parameters(), AdamWOptions(0.5));
      } else {
        writer_opt = std::make_unique<AdamW>(writer->parameters(), options);
        reader_opt = std::make_unique<FusedAdamW>(reader->parameters(), AdamWOptions(0.5));
      }
      const int rank = fsdp::get_rank();
      for (int64_t step = 0; step < 3; ++step) {
        writer_opt->zero_grad();
        forward_backward(writer, tokens_for(step, rank));
        writer_opt->step();
      }
      fsdp::load_sharded_state_dict(*reader, fsdp::sharded_state_dict(*writer));
      fsdp::load_sharded_optimizer_state_dict(*reader, *reader_opt,
                                              fsdp::sharded_optimizer_state_dict(*writer, *writer_opt));
      for (int64_t step = 3; step < 8; ++step) {
        for (auto* side : {&writer, &reader}) {
          auto& opt = side == &writer ? writer_opt : reader_opt;
          opt->zero_grad();
          forward_backward(*side, tokens_for(step, rank));
          opt->step();
        }
        expect_params_near(*writer, *reader,
                           (fused_writes ? "fused wrote, step " : "AdamW wrote, step ") + std::to_string(step));
      }
      expect_states_near(*writer, *writer_opt, *reader, *reader_opt);
      // The loaded state is one tensor per parameter, yet each shard group is still one run.
      auto* fused = dynamic_cast<FusedAdamW*>(fused_writes ? writer_opt.get() : reader_opt.get());
      ASSERT_NE(fused, nullptr);
      EXPECT_EQ(fused->last_step_stats().fused_runs, 3);
    }
  });
}

namespace {

// A sharded model and one of the two optimizers; the global batch of a step is the same at
// every world size, each rank taking its rows (as in test_checkpoint.cpp).
struct ResumableRun {
  fsdp::testing::WithBuffer model{nullptr};
  std::unique_ptr<torch::optim::Optimizer> opt;

  ResumableRun(uint64_t seed, bool fused) : model(fsdp::testing::make_sharded(seed)) {
    const auto options = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
    if (fused) opt = std::make_unique<FusedAdamW>(model->parameters(), options);
    else opt = std::make_unique<AdamW>(model->parameters(), options);
  }
  double step(int64_t s) {
    const int W = fsdp::get_world_size(), r = fsdp::get_rank();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + s);
    at::Tensor global = at::randint(0, 8, {12, 16}, gen);
    opt->zero_grad();
    at::Tensor mean = forward_backward(model, global.slice(0, r * (12 / W), (r + 1) * (12 / W))).reshape({1}).clone();
    opt->step();
    fsdp::world()->all_reduce(mean, fsdp::ReduceOp::kAvg)->wait();
    return mean.item<double>();
  }
  fsdp::ShardedStateDict state() {
    fsdp::ShardedStateDict sd;
    for (const auto& item : fsdp::sharded_state_dict(*model)) sd.insert("model." + item.key(), item.value());
    for (const auto& item : fsdp::sharded_optimizer_state_dict(*model, *opt)) {
      sd.insert("optim." + item.key(), item.value());
    }
    return sd;
  }
  void load(const fsdp::ShardedStateDict& sd) {
    fsdp::ShardedStateDict model_part, optim_part;
    for (const auto& item : sd) {
      (item.key().rfind("model.", 0) == 0 ? model_part : optim_part).insert(item.key().substr(6), item.value());
    }
    fsdp::load_sharded_state_dict(*model, model_part);
    fsdp::load_sharded_optimizer_state_dict(*model, *opt, optim_part);
  }
};

void write_losses(const std::string& path, const std::vector<double>& losses) {
  std::ofstream f(path);
  f.precision(17);
  for (double l : losses) f << l << "\n";
}

std::vector<double> read_losses(const std::string& path) {
  std::ifstream f(path);
  std::vector<double> out;
  for (double l; f >> l;) out.push_back(l);
  return out;
}

}  // namespace

TEST(FusedAdamW, CheckpointWrittenWithOneOptimizerResumesWithTheOther) {
  const std::string root = fsdp::testing::shared_temp_path("fused_adamw_ckpt");
  if (!fsdp::testing::is_child()) fs::remove_all(root);
  for (bool fused_writes : {true, false}) {
    const std::string ckpt = root + (fused_writes ? "/by_fused" : "/by_adamw");
    // Written at W = 2 after 3 steps; the writer goes on to step 6 and records its losses.
    run_distributed(2, [ckpt, fused_writes] {
      ResumableRun run(0, fused_writes);
      for (int64_t s = 0; s < 3; ++s) run.step(s);
      fsdp::save_checkpoint(ckpt, run.state());
      std::vector<double> after;
      for (int64_t s = 3; s < 6; ++s) after.push_back(run.step(s));
      if (fsdp::get_rank() == 0) write_losses(ckpt + ".losses", after);
    });
    // Resumed with the other optimizer, at the same and at another world size.
    for (int world : {2, 3}) {
      run_distributed(world, [ckpt, fused_writes] {
        ResumableRun run(123, !fused_writes);
        fsdp::init_optimizer_state(*run.opt);
        run.load(fsdp::load_checkpoint(ckpt, run.state()));
        const std::vector<double> reference = read_losses(ckpt + ".losses");
        ASSERT_EQ(reference.size(), 3u);
        for (int64_t s = 3; s < 6; ++s) {
          EXPECT_NEAR(run.step(s), reference[s - 3], kTolerance)
              << (fused_writes ? "fused wrote, AdamW resumed" : "AdamW wrote, fused resumed")
              << " at W=" << fsdp::get_world_size() << ", step " << s;
        }
      });
    }
  }
  if (!fsdp::testing::is_child()) fs::remove_all(root);
}

// DeviceStateAdamW with its state on the CPU, the stand-in for a GPU: every copy is a host copy,
// so the trajectory must be AdamW's exactly as far as the per-op arithmetic goes.
TEST(DeviceStateAdamW, OnTheCpuStandInMatchesAdamWOnAShardedTransformer) {
  for (int world : {1, 2}) {
    run_distributed(world, [] {
      for (const AdamWOptions& options : option_sets()) {
        auto model = fsdp::testing::make_sharded(5);
        auto reference = fsdp::testing::make_sharded(5);
        fsdp::optim::DeviceStateAdamW opt(model->parameters(), options, c10::Device(c10::kCPU));
        train_against_adamw(opt, model, reference, options, fsdp::get_rank());
        for (const auto& p : model->parameters()) EXPECT_TRUE(state_of(opt, p).exp_avg().is_cpu());
      }
    });
  }
}

// It is an AdamW: its sharded optimizer state dict loads into AdamW, and AdamW's into it.
TEST(DeviceStateAdamW, ItsShardedStateDictLoadsIntoAdamWAndBack) {
  run_distributed(2, [] {
    const AdamWOptions options = AdamWOptions(1e-2).weight_decay(0.1);
    auto model = fsdp::testing::make_sharded(5);
    fsdp::optim::DeviceStateAdamW opt(model->parameters(), options, c10::Device(c10::kCPU));
    for (int64_t step = 0; step < 3; ++step) {
      opt.zero_grad();
      forward_backward(model, tokens_for(step, fsdp::get_rank()));
      opt.step();
    }
    AdamW plain(model->parameters(), options);
    fsdp::init_optimizer_state(plain);
    fsdp::load_sharded_optimizer_state_dict(*model, plain, fsdp::sharded_optimizer_state_dict(*model, opt));
    fsdp::optim::DeviceStateAdamW back(model->parameters(), options, c10::Device(c10::kCPU));
    fsdp::init_optimizer_state(back);
    fsdp::load_sharded_optimizer_state_dict(*model, back, fsdp::sharded_optimizer_state_dict(*model, plain));
    for (const auto& p : model->parameters()) {
      EXPECT_EQ(state_of(back, p).step(), 3);
      EXPECT_TRUE(state_of(back, p).exp_avg().equal(state_of(opt, p).exp_avg()));
      EXPECT_TRUE(state_of(back, p).exp_avg_sq().equal(state_of(opt, p).exp_avg_sq()));
    }
  });
}
