// replicate (DDP) across real processes: parity with single-process training on the global batch,
// the buckets and their all-reduces, overlap with backward, accumulation without sync, unused
// parameters, the errors, and checkpoints exchanged with fully_shard at other world sizes.
#include "harness/multiprocess.h"
#include "parity_training.h"

#include "src/ddp/reducer.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/replicate.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <filesystem>
#include <functional>
#include <map>

namespace fs = std::filesystem;
using fsdp::CollectiveKind;
using fsdp::testing::run_distributed;

namespace {

const std::vector<int> kWorlds = {1, 2, 3, 4};

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(bool with_unused = false) {
    l1 = register_module("l1", torch::nn::Linear(5, 7));
    l2 = register_module("l2", torch::nn::Linear(7, 7));
    l3 = register_module("l3", torch::nn::Linear(7, 3));
    head = register_module("head", torch::nn::Linear(3, 1));
    if (with_unused) extra = register_module("extra", torch::nn::Linear(5, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(fsdp::call(l1, x));
    h = at::relu(fsdp::call(l2, h));
    h = at::relu(fsdp::call(l3, h));
    return fsdp::call(head, h);
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, head{nullptr}, extra{nullptr};
};
TORCH_MODULE(MLP);

MLP make_mlp(uint64_t seed, bool with_unused = false) {
  torch::manual_seed(seed);
  return MLP(with_unused);
}

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
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), tokens.slice(1, 1).reshape({-1}));
}

fsdp::models::Transformer make_transformer(uint64_t seed) {
  torch::manual_seed(seed);
  fsdp::models::ModelArgs args;
  args.dropout_p = 0.0;
  return fsdp::models::Transformer(args);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Trains `model` replicated (rank r made with seed r: replicate() must broadcast rank 0's weights)
// on this rank's rows and a reference made with seed 0 on the whole global batch, with Adam
// (parity_training.h); checks the loss every step, the all-reduce count and the averaged
// gradients per backward, and the parameters at the end.
struct ParityCase {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>(uint64_t seed)> make;
  std::function<at::Tensor(torch::nn::Module&, const at::Tensor&)> forward;
  std::function<at::Tensor(int64_t, int64_t)> batch;
  std::function<at::Tensor(const at::Tensor&, const at::Tensor&)> loss;
  fsdp::ReplicateOptions options;
  int steps = 4;
  int64_t rows_per_rank = 2;
};

void expect_parity(const ParityCase& c) {
  const int r = fsdp::get_rank();
  auto reference = c.make(0);
  auto model = c.make(static_cast<uint64_t>(r));
  fsdp::ReplicatedModule ddp = fsdp::replicate(model, c.options);
  const int64_t buckets = static_cast<int64_t>(ddp.buckets().size());
  auto group = ddp.mesh().get_group(0);
  fsdp::testing::ParityOptions o;
  o.steps = c.steps;
  o.rows_per_rank = c.rows_per_rank;
  o.batch = c.batch;
  o.loss = c.loss;
  o.every_parameter_gets_a_gradient = false;  // the per-step checks below compare every gradient
  o.before_step = [&](int, const at::Tensor&) {
    group->reset_stats();
    return true;
  };
  o.after_backward = [&](torch::nn::Module& m, torch::nn::Module& ref, int step) {
    EXPECT_EQ(group->stats()[CollectiveKind::kAllReduce].calls, buckets) << c.name << " step " << step;
    EXPECT_EQ(group->stats()[CollectiveKind::kAllGather].calls, 0) << c.name;
    EXPECT_EQ(group->stats()[CollectiveKind::kReduceScatter].calls, 0) << c.name;
    // The averaged gradients themselves (Adam alone would hide a missing division by W).
    auto ref_now = ref.named_parameters();
    for (const auto& item : m.named_parameters()) {
      EXPECT_LT(max_diff(item.value().grad(), ref_now[item.key()].grad()), 1e-5) << c.name << ": " << item.key();
    }
  };
  o.check_parameter = [](const std::string& name, const at::Tensor& p) {
    EXPECT_FALSE(fsdp::is_sharded_parameter(p)) << name;
    EXPECT_TRUE(fsdp::is_replicated_parameter(p)) << name;
  };
  fsdp::testing::expect_training_parity(reference, model, c.forward, c.name, o);
}

ParityCase mlp_case(const std::string& name, fsdp::ReplicateOptions options, bool direct_forward = false) {
  ParityCase c;
  c.name = name;
  c.make = [](uint64_t seed) { return make_mlp(seed).ptr(); };
  c.forward = [direct_forward](torch::nn::Module& m, const at::Tensor& x) {
    auto mlp = std::dynamic_pointer_cast<MLPImpl>(m.shared_from_this());
    return direct_forward ? mlp->forward(x) : fsdp::call(mlp, x);
  };
  c.batch = mlp_batch;
  c.loss = mlp_loss;
  c.options = options;
  return c;
}

ParityCase transformer_case(const std::string& name, fsdp::ReplicateOptions options) {
  ParityCase c;
  c.name = name;
  c.make = [](uint64_t seed) { return make_transformer(seed).ptr(); };
  c.forward = [](torch::nn::Module& m, const at::Tensor& tokens) {
    auto t = std::dynamic_pointer_cast<fsdp::models::TransformerImpl>(m.shared_from_this());
    return fsdp::call(t, tokens.slice(1, 0, -1));
  };
  c.batch = token_batch;
  c.loss = lm_loss;
  c.options = options;
  return c;
}

constexpr double kTinyCapMb = 100.0 / (1024 * 1024);  // 100 bytes: several buckets on the MLP

void remove_in_parent(const std::string& dir) {
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

}  // namespace

TEST(Replicate, BucketsFollowDdpAssignment) {
  // Registration order a(40 B) b(40 B) c(8 B) d(80 B, double) e(40 B); cap 64 B, first cap 32 B.
  std::vector<at::Tensor> params = {at::zeros({10}), at::zeros({10}), at::zeros({2}), at::zeros({10}, at::kDouble),
                                    at::zeros({10})};
  auto buckets = fsdp::detail::assign_buckets(params, 32, 64);
  // Reverse order: e closes the first float bucket alone (40 >= 32); d its double bucket (80 >= 32);
  // c + b reach 48 < 64, + a = 88 >= 64 closes the second float bucket.
  std::vector<std::vector<size_t>> expected = {{4}, {3}, {2, 1, 0}};
  EXPECT_EQ(buckets, expected);
  // One cap large enough for everything: one bucket per dtype.
  auto one = fsdp::detail::assign_buckets(params, 1 << 20, 1 << 20);
  std::vector<std::vector<size_t>> expected_one = {{4, 2, 1, 0}, {3}};
  EXPECT_EQ(one, expected_one);
}

TEST(Replicate, MlpParity) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      expect_parity(mlp_case("default buckets", fsdp::ReplicateOptions()));
      auto tiny = fsdp::ReplicateOptions().bucket_cap_mb(kTinyCapMb).first_bucket_cap_mb(kTinyCapMb);
      expect_parity(mlp_case("tiny buckets", tiny));
      expect_parity(mlp_case("tiny buckets, forward() called directly", tiny, /*direct_forward=*/true));
      expect_parity(mlp_case("tiny buckets as gradient views", tiny.gradient_as_bucket_view(true)));
    });
  }
}

TEST(Replicate, TransformerParity) {
  for (int world : kWorlds) {
    run_distributed(world, [] {
      expect_parity(transformer_case("transformer", fsdp::ReplicateOptions()));
      // Reentrant activation checkpointing: gradients of the blocks arrive in nested backwards;
      // the end-of-backward step still runs once, at the end of the outer one.
      ParityCase checkpointed =
          transformer_case("transformer, every block checkpointed", fsdp::ReplicateOptions().bucket_cap_mb(2.0 / 1024));
      checkpointed.make = [](uint64_t seed) {
        auto t = make_transformer(seed);
        t->set_activation_checkpointing(1);
        return t.ptr();
      };
      expect_parity(checkpointed);
      expect_parity(
          transformer_case("transformer, 2 KiB buckets",
                           fsdp::ReplicateOptions().bucket_cap_mb(2.0 / 1024).first_bucket_cap_mb(0.5 / 1024)));
    });
  }
}

TEST(Replicate, BucketsRespectTheCapsAndOrder) {
  run_distributed(2, [] {
    auto model = make_transformer(0);
    const double cap_mb = 2.0 / 1024, first_mb = 0.5 / 1024;
    auto ddp = fsdp::replicate(model, fsdp::ReplicateOptions().bucket_cap_mb(cap_mb).first_bucket_cap_mb(first_mb));
    auto params = model->named_parameters();
    std::map<std::string, int64_t> bytes_of;
    std::vector<std::string> order;
    for (const auto& item : params) {
      bytes_of[item.key()] = item.value().numel() * 4;
      order.push_back(item.key());
    }
    const auto buckets = ddp.buckets();
    ASSERT_GT(buckets.size(), 3u);
    std::vector<std::string> flat;
    for (size_t i = 0; i < buckets.size(); ++i) {
      const auto& b = buckets[i];
      const int64_t cap = static_cast<int64_t>((i == 0 ? first_mb : cap_mb) * 1024 * 1024);
      int64_t sum = 0;
      for (const auto& n : b.parameter_names) sum += bytes_of[n];
      EXPECT_EQ(sum, b.bytes);
      // Closed once at least the cap: without its last parameter it was below the cap.
      EXPECT_LT(b.bytes - bytes_of[b.parameter_names.back()], cap) << "bucket " << i;
      if (i + 1 < buckets.size()) {
        EXPECT_GE(b.bytes, cap) << "bucket " << i;
      }
      for (const auto& n : b.parameter_names) flat.push_back(n);
    }
    // Every trainable parameter exactly once, in reverse registration order.
    std::vector<std::string> reversed(order.rbegin(), order.rend());
    EXPECT_EQ(flat, reversed);
  });
}

TEST(Replicate, FirstBucketIsIssuedWhileBackwardStillRuns) {
  run_distributed(2, [] {
    auto model = make_mlp(0);
    // Every parameter its own bucket; the first buckets hold the head's gradients.
    auto ddp = fsdp::replicate(model, fsdp::ReplicateOptions().bucket_cap_mb(1e-9).first_bucket_cap_mb(1e-9));
    const int64_t buckets = static_cast<int64_t>(ddp.buckets().size());
    ASSERT_EQ(buckets, 8);
    auto group = ddp.mesh().get_group(0);
    int64_t seen_in_hook = -1;
    // Runs when l1.weight's gradient is computed, the last thing backward does for this model.
    model->l1->weight.register_hook([&](const at::Tensor& g) {
      seen_in_hook = group->stats()[CollectiveKind::kAllReduce].calls;
      return g;
    });
    group->reset_stats();
    mlp_loss(model->forward(mlp_batch(0, 2)), mlp_batch(0, 2)).backward();
    EXPECT_GE(seen_in_hook, 1) << "no bucket was issued before backward reached the first layer";
    EXPECT_LT(seen_in_hook, buckets);
    EXPECT_EQ(group->stats()[CollectiveKind::kAllReduce].calls, buckets);
  });
}

TEST(Replicate, NoSyncAccumulatesLocallyAndTheSyncedBackwardReducesIt) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      for (bool as_view : {false, true}) {
        for (bool use_guard : {true, false}) {
          auto reference = make_mlp(0);
          auto model = make_mlp(0);
          auto ddp = fsdp::replicate(model, fsdp::ReplicateOptions()
                                                .bucket_cap_mb(kTinyCapMb)
                                                .first_bucket_cap_mb(kTinyCapMb)
                                                .gradient_as_bucket_view(as_view));
          auto group = ddp.mesh().get_group(0);
          const int64_t buckets = static_cast<int64_t>(ddp.buckets().size());
          torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
          torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
          for (int step = 0; step < 2; ++step) {
            ref_opt.zero_grad();
            opt.zero_grad();
            for (int micro = 0; micro < 3; ++micro) {
              at::Tensor global = mlp_batch(10 * step + micro, 2 * W);
              at::Tensor local = global.slice(0, 2 * r, 2 * r + 2);
              mlp_loss(reference->forward(global), global).backward();
              group->reset_stats();
              if (micro < 2) {
                if (use_guard) {
                  auto guard = ddp.no_sync();
                  EXPECT_FALSE(ddp.requires_gradient_sync());
                  mlp_loss(model->forward(local), local).backward();
                } else {
                  ddp.set_requires_gradient_sync(false);
                  mlp_loss(model->forward(local), local).backward();
                  ddp.set_requires_gradient_sync(true);
                }
                EXPECT_TRUE(ddp.requires_gradient_sync());
                EXPECT_EQ(group->stats().total_calls(), 0) << "micro-batch " << micro;
              } else {
                mlp_loss(model->forward(local), local).backward();
                EXPECT_EQ(group->stats()[CollectiveKind::kAllReduce].calls, buckets);
              }
            }
            auto ref_params = reference->named_parameters();
            for (const auto& item : model->named_parameters()) {
              EXPECT_LT(max_diff(item.value().grad(), ref_params[item.key()].grad()), 1e-5)
                  << item.key() << " view " << as_view;
            }
            ref_opt.step();
            opt.step();
          }
          auto ref_params = reference->named_parameters();
          for (const auto& item : model->named_parameters()) {
            EXPECT_LT(max_diff(item.value(), ref_params[item.key()]), 1e-5) << item.key();
          }
        }
      }
    });
  }
}

TEST(Replicate, UnusedParametersFailByDefaultNamingThemAndAreZerosWhenAllowed) {
  for (int world : {1, 2}) {
    run_distributed(world, [] {
      const int r = fsdp::get_rank();
      at::Tensor x = mlp_batch(0, 2);
      {
        auto model = make_mlp(0, /*with_unused=*/true);
        auto ddp = fsdp::replicate(model);
        try {
          mlp_loss(model->forward(x), x).backward();
          ADD_FAILURE() << "backward with an unused parameter did not fail";
        } catch (const c10::Error& e) {
          const std::string msg = e.what_without_backtrace();
          EXPECT_NE(msg.find("'extra.weight'"), std::string::npos) << msg;
          EXPECT_NE(msg.find("find_unused_parameters(true)"), std::string::npos) << msg;
        }
        // The module stays usable: the next backward (using every parameter) works.
        model->zero_grad();
        (mlp_loss(model->forward(x), x) + model->extra->forward(x).sum()).backward();
      }
      {
        auto model = make_mlp(0, /*with_unused=*/true);
        auto ddp = fsdp::replicate(model, fsdp::ReplicateOptions().find_unused_parameters(true));
        auto group = ddp.mesh().get_group(0);
        group->reset_stats();
        // extra is used on rank 0 only.
        at::Tensor loss = mlp_loss(model->forward(x), x);
        if (r == 0) loss = loss + model->extra->forward(x).sum();
        loss.backward();
        EXPECT_EQ(group->stats()[CollectiveKind::kAllReduce].calls,
                  static_cast<int64_t>(ddp.buckets().size()) + 1);  // + the used-parameter map
        // Used on rank 0 only: the mean of rank 0's gradient and zeros.
        at::Tensor expect = x.sum(0, true) / static_cast<double>(fsdp::get_world_size());
        EXPECT_LT(max_diff(model->extra->weight.grad(), expect), 1e-5);
      }
      {
        // Unused on every rank: its gradient stays as it was (undefined here).
        auto model = make_mlp(0, /*with_unused=*/true);
        fsdp::replicate(model, fsdp::ReplicateOptions().find_unused_parameters(true));
        mlp_loss(model->forward(x), x).backward();
        EXPECT_FALSE(model->extra->weight.grad().defined());
        EXPECT_TRUE(model->l1->weight.grad().defined());
      }
    });
  }
}

TEST(Replicate, RefusesTwoDMeshesBadCapsAndDoubleManagement) {
  run_distributed(2, [] {
    auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
      try {
        f();
        ADD_FAILURE() << "expected an error containing '" << needle << "'";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos)
            << e.what_without_backtrace();
      }
    };
    auto mesh2d = fsdp::init_device_mesh("cpu", {1, 2}, {"replicate", "shard"});
    expect_error([&] { fsdp::replicate(make_mlp(0), fsdp::ReplicateOptions().mesh(mesh2d)); }, "1-D mesh");
    expect_error([&] { fsdp::replicate(make_mlp(0), fsdp::ReplicateOptions().bucket_cap_mb(0)); }, "bucket_cap_mb");
    {
      auto m = make_mlp(0);
      fsdp::fully_shard(m);
      expect_error([&] { fsdp::replicate(m); }, "managed by fully_shard");
    }
    {
      auto m = make_mlp(0);
      fsdp::replicate(m);
      expect_error([&] { fsdp::fully_shard(m); }, "managed by replicate");
      expect_error([&] { fsdp::replicate(m); }, "already applied");
      expect_error([&] { fsdp::replicate(m->l1); }, "already reduced by another replicate");
      expect_error([&] { fsdp::fully_shard(m->l1); }, "reduced by the replicate() of an enclosing module");
    }
    {
      // A dtype change after replicate(): the backward fails (on every rank, after reducing
      // every bucket) saying to change dtypes first.
      auto m = make_mlp(0, /*with_unused=*/true);
      fsdp::replicate(m);
      m->extra->to(at::kDouble);
      at::Tensor x = mlp_batch(0, 2);
      expect_error(
          [&] { (mlp_loss(m->forward(x), x) + m->extra->forward(x.to(at::kDouble)).sum().to(at::kFloat)).backward(); },
          "parameters 'extra.weight', 'extra.bias' changed dtype or device after replicate()");
    }
    {
      // fully_shard of a parent leaves a replicated submodule to replicate().
      auto m = make_mlp(0);
      fsdp::replicate(m->l2);
      fsdp::fully_shard(m);
      EXPECT_TRUE(fsdp::is_replicated_parameter(m->l2->weight));
      for (const auto& item : m->named_parameters()) {
        EXPECT_EQ(fsdp::is_sharded_parameter(item.value()), item.key().rfind("l2.", 0) != 0) << item.key();
      }
    }
    {
      // replicate of a parent leaves fully_shard()ed submodules to fully_shard, as in PyTorch.
      auto m = make_mlp(0);
      fsdp::fully_shard(m->l1);
      auto ddp = fsdp::replicate(m);
      for (const auto& b : ddp.buckets()) {
        for (const auto& n : b.parameter_names) EXPECT_NE(n.rfind("l1.", 0), 0u) << n;
      }
    }
  });
}

TEST(Replicate, CheckpointsMoveBetweenReplicateAndFullyShardAcrossWorldSizes) {
  const std::string root = fsdp::testing::shared_temp_path("ckpt_replicate");
  remove_in_parent(root);
  // Two Adam steps on the global batch, replicated or sharded, then model + optimizer state.
  auto train_and_save = [root](bool replicated, const std::string& name) {
    return [root, replicated, name] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto model = make_transformer(0);
      if (replicated) {
        fsdp::replicate(model);
      } else {
        for (auto& block : model->blocks()) fsdp::fully_shard(block);
        fsdp::fully_shard(model);
      }
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
      for (int step = 0; step < 2; ++step) {
        at::Tensor global = token_batch(step, 4);
        at::Tensor local = global.slice(0, r * (4 / W), (r + 1) * (4 / W));
        opt.zero_grad();
        lm_loss(fsdp::call(model, local.slice(1, 0, -1)), local).backward();
        opt.step();
      }
      fsdp::ShardedStateDict sd;
      for (const auto& item : fsdp::sharded_state_dict(*model)) {
        if (replicated) {
          EXPECT_EQ(item.value().placements()[0], fsdp::Replicate()) << item.key();
        }
        sd.insert("model." + item.key(), item.value());
      }
      for (const auto& item : fsdp::sharded_optimizer_state_dict(*model, opt))
        sd.insert("optim." + item.key(), item.value());
      fsdp::save_checkpoint(root + "/" + name, sd);
      // The whole values, for the loaders to compare with.
      fsdp::TensorStateDict full;
      for (const auto& item : sd) full.insert(item.key(), item.value().full_tensor());
      if (r == 0) fsdp::save_pytorch_state_dict(full, root + "/" + name + ".pt");
      if (replicated && W > 1) {  // replicated pieces are written by the mesh's first rank only
        EXPECT_EQ(fs::file_size(root + "/" + name + "/rank_1.data"), 0u);
      }
    };
  };
  auto load_and_check = [root](bool replicated, const std::string& name) {
    return [root, replicated, name] {
      auto model = make_transformer(7);
      if (replicated) {
        fsdp::replicate(model);
      } else {
        for (auto& block : model->blocks()) fsdp::fully_shard(block);
        fsdp::fully_shard(model);
      }
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
      fsdp::init_optimizer_state(opt);
      fsdp::ShardedStateDict like;
      for (const auto& item : fsdp::sharded_state_dict(*model)) like.insert("model." + item.key(), item.value());
      for (const auto& item : fsdp::sharded_optimizer_state_dict(*model, opt))
        like.insert("optim." + item.key(), item.value());
      fsdp::ShardedStateDict loaded = fsdp::load_checkpoint(root + "/" + name, like);
      fsdp::ShardedStateDict model_part, optim_part;
      for (const auto& item : loaded) {
        const std::string& k = item.key();
        if (k.rfind("model.", 0) == 0) model_part.insert(k.substr(6), item.value());
        else optim_part.insert(k.substr(6), item.value());
      }
      fsdp::load_sharded_state_dict(*model, model_part);
      fsdp::load_sharded_optimizer_state_dict(*model, opt, optim_part);
      const fsdp::TensorStateDict expected = fsdp::load_pytorch_state_dict(root + "/" + name + ".pt");
      for (const auto& item : fsdp::full_state_dict(*model)) {
        EXPECT_LT(max_diff(item.value(), expected["model." + item.key()]), 1e-6) << name << ": " << item.key();
      }
      for (const auto& item : fsdp::sharded_optimizer_state_dict(*model, opt)) {
        EXPECT_LT(max_diff(item.value().full_tensor().to(at::kDouble), expected["optim." + item.key()].to(at::kDouble)),
                  1e-6)
            << name << ": " << item.key();
      }
    };
  };
  run_distributed(2, train_and_save(/*replicated=*/true, "from_replicate"));
  run_distributed(4, load_and_check(/*replicated=*/false, "from_replicate"));
  run_distributed(1, load_and_check(/*replicated=*/false, "from_replicate"));
  run_distributed(1, load_and_check(/*replicated=*/true, "from_replicate"));
  run_distributed(2, train_and_save(/*replicated=*/false, "from_fully_shard"));
  run_distributed(4, load_and_check(/*replicated=*/true, "from_fully_shard"));
  run_distributed(1, load_and_check(/*replicated=*/true, "from_fully_shard"));
  // The two runs trained the same model on the same global batches.
  if (!fsdp::testing::is_child()) {
    auto a = fsdp::load_pytorch_state_dict(root + "/from_replicate.pt");
    auto b = fsdp::load_pytorch_state_dict(root + "/from_fully_shard.pt");
    for (const auto& item : a) {
      if (item.key().rfind("model.", 0) == 0) {
        EXPECT_LT(max_diff(item.value(), b[item.key()]), 1e-5) << item.key();
      }
    }
  }
  remove_in_parent(root);
}
