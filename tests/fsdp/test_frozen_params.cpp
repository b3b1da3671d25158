// Parameters FSDP does not reduce, across real processes: ignored parameters (left plain, their
// gradients synchronized by the user), frozen parameters (gathered for forward, never reduced,
// frozen and unfrozen between iterations, also under HSDP and mixed precision), and unused ones
// (a module never called, an output the loss does not use). Each is trained beside a
// single-process reference on the global batch.
#include "harness/multiprocess.h"
#include "parity_training.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <filesystem>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

using fsdp::CollectiveKind;
using fsdp::testing::run_distributed;

namespace {

constexpr int64_t kDim = 5;  // dim 0 of every layer: uneven over 2, 3 and 4 ranks
constexpr int64_t kRowsPerRank = 2;

// x -> tanh(layer_i(x)) for i = 0..2 -> (head(h), aux(h)). The loss uses only head's output,
// so aux gets no gradient; `never` is never called.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(11);
    for (int i = 0; i < 3; ++i) {
      layers.push_back(register_module("layer" + std::to_string(i), torch::nn::Linear(kDim, kDim)));
    }
    aux = register_module("aux", torch::nn::Linear(kDim, 2));
    never = register_module("never", torch::nn::Linear(kDim, kDim));
    head = register_module("head", torch::nn::Linear(kDim, 1));
  }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    at::Tensor h = x;
    for (auto& layer : layers) h = at::tanh(fsdp::call(layer, h));
    return {fsdp::call(head, h), fsdp::call(aux, h)};
  }
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear aux{nullptr}, never{nullptr}, head{nullptr};
};
TORCH_MODULE(Net);

// fully_shard on each layer, aux and never (with `ignored` where they belong), then the root,
// whose group holds head: the ignored params of the call on layer i, and of the root's call.
struct Sharding {
  using Tensors = std::vector<at::Tensor>;
  std::function<Tensors(Net&, int)> ignored_in_layer = [](Net&, int) { return Tensors{}; };
  std::function<Tensors(Net&)> ignored_in_root = [](Net&) { return Tensors{}; };
};

void shard(Net& model, const fsdp::FullyShardOptions& opts, const Sharding& s = Sharding()) {
  for (int i = 0; i < 3; ++i) {
    fsdp::fully_shard(model->layers[i], fsdp::FullyShardOptions(opts).ignored_params(s.ignored_in_layer(model, i)));
  }
  fsdp::fully_shard(model->aux, opts);
  fsdp::fully_shard(model->never, opts);
  fsdp::fully_shard(model, fsdp::FullyShardOptions(opts).ignored_params(s.ignored_in_root(model)));
}

void shard(Net& model, const fsdp::DeviceMesh& mesh, const Sharding& s = Sharding()) {
  shard(model, fsdp::FullyShardOptions().mesh(mesh), s);
}

at::Tensor global_batch(int64_t step, int64_t world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  return at::randn({kRowsPerRank * world, kDim}, gen);
}

at::Tensor local_batch(int64_t step) {
  const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
  return global_batch(step, W).slice(0, r * kRowsPerRank, (r + 1) * kRowsPerRank);
}

// head's output: what the loss uses (parity_training.h's parity_loss).
at::Tensor net_output(torch::nn::Module& m, const at::Tensor& x) {
  auto net = std::dynamic_pointer_cast<NetImpl>(m.shared_from_this());
  return std::get<0>(fsdp::call(net, x));
}

at::Tensor loss_of(Net& model, const at::Tensor& x) { return fsdp::testing::parity_loss(net_output(*model, x), x); }

// The whole value of a parameter of the FSDP model: gathered if sharded, as it is if not.
at::Tensor full_of(const at::Tensor& p) {
  return fsdp::is_sharded_parameter(p) ? fsdp::as_dtensor(p).full_tensor() : p.detach();
}

// What a step does besides forward and backward: freezing (on the FSDP model through its
// registered shards, i.e. named_parameters(), and on the reference alike), and, after the FSDP
// backward, the user's own synchronization.
struct StepHooks {
  std::function<void(torch::nn::Module&, int64_t step)> before_step = [](torch::nn::Module&, int64_t) {};
  std::function<void(Net& model)> after_backward = [](Net&) {};
  std::function<void(Net& model, int64_t step)> check_step = [](Net&, int64_t) {};
  // Steps preceded by a forward under torch::NoGradGuard (both models).
  std::function<bool(int64_t step)> no_grad_forward_before = [](int64_t) { return false; };
};

// Trains `model` (sharded) on this rank's rows and `ref` on the global batch for `steps` steps of
// AdamW (parity_training.h); the mean loss matches at every step and every parameter at the end.
void train_in_parity(Net& model, Net& ref, int64_t steps, const StepHooks& hooks) {
  fsdp::testing::ParityOptions o;
  o.steps = static_cast<int>(steps);
  o.rows_per_rank = kRowsPerRank;
  o.batch = [](int64_t step, int64_t rows) { return global_batch(step, rows / kRowsPerRank); };
  o.optimizer = [](torch::nn::Module& m) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::AdamW>(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  };
  o.before_both = [&](torch::nn::Module& m, bool is_reference, int step) {
    hooks.before_step(m, step);
    if (hooks.no_grad_forward_before(step)) {
      at::NoGradGuard no_grad;
      net_output(m, is_reference ? global_batch(step, fsdp::get_world_size()) : local_batch(step));
    }
  };
  o.every_parameter_gets_a_gradient = false;  // frozen and unused parameters get none
  o.after_backward = [&](torch::nn::Module&, torch::nn::Module&, int step) {
    hooks.after_backward(model);
    hooks.check_step(model, step);
  };
  fsdp::testing::expect_training_parity(ref.ptr(), model.ptr(), net_output, "frozen", o);
}

// The sharded parameter (or ignored plain one) registered under `name`.
at::Tensor param(torch::nn::Module& m, const std::string& name) { return m.named_parameters()[name]; }

// The mean of each ignored parameter's gradient over the ranks: the user's synchronization.
void all_reduce_grads(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) {
    if (p.grad().defined()) fsdp::world()->all_reduce(p.grad(), fsdp::ReduceOp::kAvg)->wait();
  }
}

std::vector<at::Tensor> ignored_of(torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  for (const auto& p : model.parameters()) {
    if (!fsdp::is_sharded_parameter(p)) out.push_back(p);
  }
  return out;
}

}  // namespace

// ------------------------------------------------------------------------------ ignored params

// layer1 is wholly ignored (its call creates no group) and head.weight is ignored inside the
// root's group. They stay the module's own tensors, the user all-reduces their gradients, and
// training matches the reference; state dicts and checkpoints hold them as whole tensors.
TEST(IgnoredParams, StayPlainTrainWithTheUsersAllReduceAndRoundTripThroughCheckpoints) {
  const std::string dir = fsdp::testing::shared_temp_path("ignored_params_ckpt");
  for (int world : {1, 2, 3, 4}) {
    if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
    run_distributed(world, [dir] {
      const int64_t W = fsdp::get_world_size();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      Net model, ref;
      const at::Tensor l1_weight = model->layers[1]->weight, head_weight = model->head->weight;
      Sharding s;
      s.ignored_in_layer = [](Net& m, int i) { return i == 1 ? m->layers[1]->parameters() : Sharding::Tensors{}; };
      s.ignored_in_root = [](Net& m) { return std::vector<at::Tensor>{m->head->weight}; };
      shard(model, mesh, s);

      EXPECT_FALSE(fsdp::is_sharded_parameter(param(*model, "layer1.weight")));
      EXPECT_TRUE(param(*model, "layer1.weight").is_same(l1_weight)) << "the registered tensor is the module's own";
      EXPECT_TRUE(param(*model, "head.weight").is_same(head_weight));
      EXPECT_TRUE(model->layers[1]->weight.equal(ref->layers[1]->weight)) << "not freed, not moved";
      EXPECT_TRUE(fsdp::is_sharded_parameter(param(*model, "head.bias")));
      EXPECT_TRUE(fsdp::is_sharded_parameter(param(*model, "layer0.weight")));
      EXPECT_TRUE(fsdp::is_fsdp_module(*model->layers[1])) << "still an FSDP module, only without a group";
      EXPECT_EQ(ignored_of(*model).size(), 3u);  // layer1.weight, layer1.bias, head.weight

      auto pg = mesh.get_group(0);
      pg->reset_stats();
      {
        at::NoGradGuard no_grad;
        fsdp::call(model, local_batch(0));
      }
      // layer0, layer2, aux and the root (head.bias) gather; layer1 has no group; never does not run.
      if (W > 1) {
        EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 4);
      }
      StepHooks hooks;
      hooks.before_step = [&](torch::nn::Module&, int64_t) { pg->reset_stats(); };
      hooks.after_backward = [](Net& m) { all_reduce_grads(ignored_of(*m)); };
      hooks.check_step = [&](Net& m, int64_t) {
        if (W > 1) {
          EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, 3) << "layer0, layer2, root";
        }
        EXPECT_TRUE(param(*m, "layer1.weight").grad().defined());
      };
      train_in_parity(model, ref, 4, hooks);

      // State dicts: whole tensors under their own names.
      const fsdp::TensorStateDict full = fsdp::full_state_dict(*model);
      EXPECT_TRUE(full["layer1.weight"].equal(model->layers[1]->weight));
      EXPECT_TRUE(full["head.weight"].equal(model->head->weight));
      const fsdp::ShardedStateDict sharded = fsdp::sharded_state_dict(*model);
      EXPECT_EQ(sharded["layer1.weight"].placements(), std::vector<fsdp::Placement>{fsdp::Replicate()});
      EXPECT_EQ(sharded["layer1.weight"].to_local().data_ptr(), l1_weight.data_ptr()) << "shares the live tensor";

      // Checkpoint round trip: save, overwrite every parameter, load back.
      fsdp::save_checkpoint(dir, sharded);
      {
        at::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.zero_();
      }
      fsdp::load_sharded_state_dict(*model, fsdp::load_checkpoint(dir, fsdp::sharded_state_dict(*model)));
      for (const auto& item : fsdp::full_state_dict(*model)) {
        EXPECT_TRUE(item.value().equal(full[item.key()])) << item.key();
      }
      EXPECT_TRUE(param(*model, "layer1.weight").is_same(l1_weight)) << "loaded in place";
      // And from whole tensors.
      {
        at::NoGradGuard no_grad;
        for (auto& p : model->parameters()) p.zero_();
      }
      fsdp::load_full_state_dict(*model, full);
      EXPECT_TRUE(model->layers[1]->weight.equal(full["layer1.weight"]));
      EXPECT_TRUE(full_of(param(*model, "layer0.weight")).equal(full["layer0.weight"]));
    });
  }
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
}

TEST(IgnoredParams, ACallWhoseEveryParameterIsIgnoredCreatesNoGroup) {
  for (int world : {1, 2}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      torch::manual_seed(5);
      torch::nn::Linear lin(kDim, 3);
      const at::Tensor before = lin->weight.detach().clone();
      auto handle = fsdp::fully_shard(lin, fsdp::FullyShardOptions().mesh(mesh).ignored_params(lin->parameters()));
      EXPECT_TRUE(fsdp::is_fsdp_module(*lin));
      auto pg = mesh.get_group(0);
      pg->reset_stats();
      fsdp::call(lin, local_batch(0)).sum().backward();
      EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 0);
      EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, 0);
      EXPECT_EQ(handle.unsharded_parameter_bytes(), 0);
      for (const auto& p : lin->parameters()) {
        EXPECT_FALSE(fsdp::is_sharded_parameter(p));
        EXPECT_TRUE(p.grad().defined()) << "the local gradient, not reduced";
      }
      EXPECT_TRUE(lin->weight.equal(before));
      // An undefined tensor in the list is refused, naming its index.
      torch::nn::Linear other(kDim, 3);
      try {
        fsdp::fully_shard(other, fsdp::FullyShardOptions().mesh(mesh).ignored_params({other->weight, at::Tensor()}));
        ADD_FAILURE() << "expected an error";
      } catch (const c10::Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("ignored_params[1] is an undefined tensor"), std::string::npos) << msg;
      }
    });
  }
}

// ------------------------------------------------------------------------------ frozen params

// BitFit: only the biases train. The reduce-scatters carry only bias bytes, and training
// matches the reference that freezes the same parameters.
TEST(FrozenParams, BitFitReduceScattersOnlyBiasBytes) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      Net model, ref;
      shard(model, mesh);
      // Frozen after fully_shard, through the registered shards.
      for (auto* m : {static_cast<torch::nn::Module*>(model.get()), static_cast<torch::nn::Module*>(ref.get())}) {
        for (auto& item : m->named_parameters()) {
          if (item.key().find("weight") != std::string::npos) item.value().set_requires_grad(false);
        }
      }
      auto pg = mesh.get_group(0);
      StepHooks hooks;
      hooks.check_step = [&](Net& m, int64_t step) {
        for (const auto& item : m->named_parameters()) {
          const bool trains = item.key().find("bias") != std::string::npos && item.key().rfind("aux", 0) != 0 &&
                              item.key().rfind("never", 0) != 0;
          if (step == 0) {
            EXPECT_EQ(item.value().grad().defined(), trains) << item.key();
          }
        }
        if (W == 1) return;
        const auto rs = pg->stats()[CollectiveKind::kReduceScatter];
        // layer0..2 and the root (head): each reduces its bias's padded shard only; the ring
        // sends its output's size W - 1 times.
        const int64_t shard = (kDim + W - 1) / W;
        EXPECT_EQ(rs.calls, 4) << "step " << step;
        EXPECT_EQ(rs.bytes_sent, (W - 1) * (3 * shard + 1) * 4) << "step " << step;
        pg->reset_stats();
      };
      pg->reset_stats();
      train_in_parity(model, ref, 3, hooks);
      // The weights never moved (no gradient ever, so AdamW's decay skips them too).
      auto ref_params = ref->named_parameters();
      for (const auto& item : model->named_parameters()) {
        if (item.key().find("weight") != std::string::npos) {
          EXPECT_TRUE(full_of(item.value()).equal(ref_params[item.key()])) << item.key();
        }
      }
    });
  }
}

namespace {

// Layer 0 is frozen on even steps and layer 1 on odd ones, set on the registered shards (and on
// the reference's parameters) before each step; step 3 is preceded by a forward under
// NoGradGuard. Each backward reduce-scatters over `rs_group` only the unfrozen layer of the two,
// layer2 and the root.
void train_with_alternating_frozen_layers(const fsdp::FullyShardOptions& opts,
                                          const std::shared_ptr<fsdp::ProcessGroup>& rs_group) {
  Net model, ref;
  shard(model, opts);
  StepHooks hooks;
  auto frozen_layer = [](int64_t step) { return "layer" + std::to_string(step % 2) + "."; };
  hooks.before_step = [&](torch::nn::Module& m, int64_t step) {
    for (auto& item : m.named_parameters()) {
      const bool in_layer01 = item.key().rfind("layer0.", 0) == 0 || item.key().rfind("layer1.", 0) == 0;
      if (in_layer01) item.value().set_requires_grad(item.key().rfind(frozen_layer(step), 0) != 0);
    }
    rs_group->reset_stats();
  };
  hooks.no_grad_forward_before = [](int64_t step) { return step == 3; };
  hooks.check_step = [&](Net& m, int64_t step) {
    const std::string frozen = frozen_layer(step);
    const std::string trained = "layer" + std::to_string(1 - step % 2) + ".";
    EXPECT_TRUE(param(*m, trained + "weight").grad().defined()) << "step " << step;
    if (step == 0) {
      EXPECT_FALSE(param(*m, frozen + "weight").grad().defined());
    }
    if (rs_group->size() > 1) {
      EXPECT_EQ(rs_group->stats()[CollectiveKind::kReduceScatter].calls, 3) << "step " << step;
    }
  };
  train_in_parity(model, ref, 6, hooks);
}

}  // namespace

TEST(FrozenParams, FreezingAndUnfreezingBetweenIterationsMatchesTheReference) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      auto mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
      train_with_alternating_frozen_layers(fsdp::FullyShardOptions().mesh(mesh), mesh.get_group(0));
    });
  }
}

// The same under HSDP (2 replicas x 2 shards), where trainable parameters without a gradient
// may join partial sums: frozen ones never do.
TEST(FrozenParams, FreezingAndUnfreezingUnderHsdpMatchesTheReference) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    train_with_alternating_frozen_layers(fsdp::FullyShardOptions().mesh(mesh), mesh.get_group(1));
  });
}

// Under a mixed-precision policy the unsharded faces are bf16 tensors of their own; they follow
// the fp32 shards' requires_grad all the same, and the gradients of what trains stay fp32.
TEST(FrozenParams, FreezingFollowsTheShardsUnderMixedPrecision) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto mp = fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    Net model;
    shard(model, fsdp::FullyShardOptions().mesh(mesh).mp_policy(mp));
    auto pg = mesh.get_group(0);
    for (int64_t step = 0; step < 2; ++step) {
      const std::string frozen = step == 0 ? "layer0." : "layer1.", trained = step == 0 ? "layer1." : "layer0.";
      for (auto& item : model->named_parameters()) {
        if (item.key().rfind("layer0.", 0) == 0 || item.key().rfind("layer1.", 0) == 0) {
          item.value().mutable_grad().reset();
          item.value().set_requires_grad(item.key().rfind(frozen, 0) != 0);
        }
      }
      pg->reset_stats();
      loss_of(model, local_batch(step)).backward();
      EXPECT_FALSE(param(*model, frozen + "weight").grad().defined()) << "step " << step;
      ASSERT_TRUE(param(*model, trained + "weight").grad().defined()) << "step " << step;
      EXPECT_EQ(param(*model, trained + "weight").grad().scalar_type(), at::kFloat);
      EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, 3) << "step " << step;
    }
  });
}

// ------------------------------------------------------------------------------ unused params

// `never` is never called and aux's output is not in the loss: their shards keep no gradient,
// their groups issue no reduce-scatter, and AdamW with weight decay leaves them exactly as the
// unsharded model does (untouched).
TEST(UnusedParams, KeepNoGradientIssueNoReduceScatterAndAdamWLeavesThemExactly) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      Net model, ref;
      shard(model, mesh);
      auto pg = mesh.get_group(0);
      fsdp::TensorStateDict initial = fsdp::full_state_dict(*model);
      StepHooks hooks;
      hooks.before_step = [&](torch::nn::Module&, int64_t) { pg->reset_stats(); };
      hooks.check_step = [&](Net& m, int64_t step) {
        for (const std::string name : {"never.weight", "never.bias", "aux.weight", "aux.bias"}) {
          EXPECT_FALSE(param(*m, name).grad().defined()) << name << " step " << step;
        }
        EXPECT_TRUE(param(*m, "layer0.weight").grad().defined());
        // layer0..2 and the root; aux and never have nothing to reduce.
        if (W > 1) {
          EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, 4) << "step " << step;
        }
      };
      train_in_parity(model, ref, 3, hooks);
      auto ref_params = ref->named_parameters();
      for (const std::string name : {"never.weight", "never.bias", "aux.weight", "aux.bias"}) {
        const at::Tensor got = full_of(param(*model, name));
        EXPECT_TRUE(got.equal(ref_params[name])) << name << " equals the unsharded model's bitwise";
        EXPECT_TRUE(got.equal(initial[name])) << name << " was never stepped";
      }
    });
  }
}
