// fully_shard across real processes: parity with single-process training on the global batch,
// collective counts, memory, clip_grad_norm_, and the end-of-backward reduction.
#include "harness/multiprocess.h"
#include "parity_training.h"

#include <fsdp/call.h>
#include <fsdp/clip_grad.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <functional>

using fsdp::CollectiveKind;
using fsdp::testing::run_distributed;

namespace {

// An MLP whose sizes do not divide the world (dim 0 of 3 and 1 is below W = 4 too).
// `reuse` calls l2 twice in one forward.
struct MLPImpl : torch::nn::Module {
  MLPImpl(bool reuse) : reuse(reuse) {
    l1 = register_module("l1", torch::nn::Linear(5, 7));
    l2 = register_module("l2", torch::nn::Linear(7, 7));
    l3 = register_module("l3", torch::nn::Linear(7, 3));
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(fsdp::call(l1, x));
    h = at::relu(fsdp::call(l2, h));
    if (reuse) h = at::tanh(fsdp::call(l2, h));
    h = at::relu(fsdp::call(l3, h));
    return fsdp::call(head, h);
  }
  bool reuse;
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, head{nullptr};
};
TORCH_MODULE(MLP);

struct Case {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> make;  // same weights on every call
  std::function<void(std::shared_ptr<torch::nn::Module>, int world)> shard;
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)> forward;
  std::function<at::Tensor(int64_t step, int64_t rows)> batch;  // the global batch of a step
  std::function<at::Tensor(const at::Tensor& out, const at::Tensor& batch)> loss;
  std::function<void(torch::nn::Module&)> before_forward = [](torch::nn::Module&) {};
  int steps = 10;
  int64_t rows_per_rank = 2;
};

at::Tensor mlp_batch(int64_t step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return at::randn({rows, 5}, gen);
}

at::Tensor mlp_loss(const at::Tensor& out, const at::Tensor& x) { return (out - x.sum(1, true)).pow(2).mean(); }

at::Tensor token_batch(int64_t step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + step);
  return at::randint(0, 8, {rows, 17}, gen);
}

at::Tensor lm_loss(const at::Tensor& logits, const at::Tensor& tokens) {
  at::Tensor target = tokens.slice(1, 1);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape({-1}));
}

// Trains `c` under FSDP on this rank's rows and, alongside, an unsharded replica on the whole
// global batch (parity_training.h); every parameter is a Shard(0) DTensor.
void expect_parity(const Case& c) {
  auto reference = c.make();
  auto model = c.make();
  c.shard(model, fsdp::get_world_size());
  fsdp::testing::ParityOptions o;
  o.steps = c.steps;
  o.rows_per_rank = c.rows_per_rank;
  o.batch = c.batch;
  o.loss = c.loss;
  o.every_parameter_gets_a_gradient = false;  // not every case uses every parameter
  o.before_step = [&](int, const at::Tensor&) {
    c.before_forward(*model);
    return true;
  };
  o.check_parameter = [](const std::string& name, const at::Tensor& p) {
    ASSERT_TRUE(fsdp::is_sharded_parameter(p)) << name;
    EXPECT_EQ(fsdp::as_dtensor(p).placements()[0], fsdp::Shard(0)) << name;
  };
  fsdp::testing::expect_training_parity(reference, model, c.forward, c.name, o);
}

std::shared_ptr<torch::nn::Module> make_mlp(bool reuse) {
  torch::manual_seed(0);
  return MLP(reuse).ptr();
}

at::Tensor mlp_forward(torch::nn::Module& m, const at::Tensor& x) {
  auto mlp = std::dynamic_pointer_cast<MLPImpl>(m.shared_from_this());
  return fsdp::call(mlp, x);
}

void shard_mlp_per_layer(std::shared_ptr<torch::nn::Module> m, fsdp::ReshardAfterForward raf) {
  auto mlp = std::dynamic_pointer_cast<MLPImpl>(m);
  auto opts = fsdp::FullyShardOptions().reshard_after_forward(raf);
  for (auto layer : {mlp->l1, mlp->l2, mlp->l3}) fsdp::fully_shard(layer, opts);
  fsdp::fully_shard(m, opts);
}

Case mlp_case(const std::string& name, std::function<void(std::shared_ptr<torch::nn::Module>, int)> shard,
              bool reuse = false) {
  Case c;
  c.name = name;
  c.make = [reuse] { return make_mlp(reuse); };
  c.shard = std::move(shard);
  c.forward = mlp_forward;
  c.batch = mlp_batch;
  c.loss = mlp_loss;
  return c;
}

fsdp::models::ModelArgs tiny_args() {
  fsdp::models::ModelArgs a;  // the tiny preset
  a.dropout_p = 0.0;
  return a;
}

std::shared_ptr<torch::nn::Module> make_transformer() {
  torch::manual_seed(0);
  return fsdp::models::Transformer(tiny_args()).ptr();
}

at::Tensor transformer_forward(torch::nn::Module& m, const at::Tensor& tokens) {
  auto t = std::dynamic_pointer_cast<fsdp::models::TransformerImpl>(m.shared_from_this());
  return fsdp::call(t, tokens.slice(1, 0, -1));
}

void shard_transformer(std::shared_ptr<torch::nn::Module> m) {
  auto t = std::dynamic_pointer_cast<fsdp::models::TransformerImpl>(m);
  for (auto& block : t->blocks()) fsdp::fully_shard(block);
  fsdp::fully_shard(m);
}

Case transformer_case() {
  Case c;
  c.name = "transformer";
  c.make = make_transformer;
  c.shard = [](std::shared_ptr<torch::nn::Module> m, int) { shard_transformer(m); };
  c.forward = transformer_forward;
  c.batch = token_batch;
  c.loss = lm_loss;
  return c;
}

const std::vector<int> kWorlds = {1, 2, 3, 4};

}  // namespace

TEST(FullyShard, MlpParityPerLayerAndRootOnly) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      expect_parity(mlp_case("per layer + root", [](auto m, int) { shard_mlp_per_layer(m, {}); }));
      expect_parity(mlp_case("root only", [](auto m, int) { fsdp::fully_shard(m); }));
    });
  }
}

TEST(FullyShard, MlpParityForEachReshardAfterForward) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size();
      expect_parity(mlp_case("reshard true", [](auto m, int) { shard_mlp_per_layer(m, true); }));
      expect_parity(mlp_case("reshard false", [](auto m, int) { shard_mlp_per_layer(m, false); }));
      if (W % 2 == 0) expect_parity(mlp_case("reshard int 2", [](auto m, int) { shard_mlp_per_layer(m, 2); }));
    });
  }
}

TEST(FullyShard, MlpParityWithPrefetchUnshardAndReuse) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      // Explicit prefetch, two layers ahead in forward and two behind in backward.
      expect_parity(mlp_case("explicit prefetch", [](auto m, int) {
        auto mlp = std::dynamic_pointer_cast<MLPImpl>(m);
        std::vector<fsdp::FSDPModule> layers;
        for (auto layer : {mlp->l1, mlp->l2, mlp->l3}) layers.push_back(fsdp::fully_shard(layer));
        fsdp::fully_shard(m);
        for (size_t i = 0; i < layers.size(); ++i) {
          std::vector<fsdp::FSDPModule> ahead(layers.begin() + i + 1, layers.begin() + std::min(layers.size(), i + 3));
          layers[i].set_modules_to_forward_prefetch(ahead);
          std::vector<fsdp::FSDPModule> behind;
          for (size_t k = i; k-- > 0 && behind.size() < 2;) behind.push_back(layers[k]);
          layers[i].set_modules_to_backward_prefetch(behind);
        }
      }));
      // An asynchronous unshard() of the root before each forward, waited for by its pre-forward.
      Case u = mlp_case("unshard before forward", [](auto m, int) { shard_mlp_per_layer(m, {}); });
      u.before_forward = [](torch::nn::Module& m) { fsdp::get_fsdp_module(m).unshard(/*async_op=*/true); };
      expect_parity(u);
      expect_parity(mlp_case(
          "module called twice", [](auto m, int) { shard_mlp_per_layer(m, {}); }, true));
    });
  }
}

TEST(FullyShard, TransformerParity) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      expect_parity(transformer_case());
      Case root_only = transformer_case();
      root_only.name = "transformer root only";
      root_only.shard = [](std::shared_ptr<torch::nn::Module> m, int) { fsdp::fully_shard(m); };
      expect_parity(root_only);
      // One group for two modules: the final norm and the output head.
      Case grouped = transformer_case();
      grouped.name = "transformer, norm + output in one group";
      grouped.shard = [](std::shared_ptr<torch::nn::Module> m, int) {
        auto t = std::dynamic_pointer_cast<fsdp::models::TransformerImpl>(m);
        for (auto& block : t->blocks()) fsdp::fully_shard(block);
        fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{t->norm.ptr(), t->output.ptr()});
        fsdp::fully_shard(m);
      };
      expect_parity(grouped);
    });
  }
}
