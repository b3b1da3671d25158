// Activation checkpointing (fsdp/checkpoint_activations.h): a checkpointed run computes the
// losses, gradients and random sequence of the same run without checkpointing, keeps less
// memory, and under FSDP all-gathers and reduce-scatters exactly as counted below.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint_activations.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/mixed_precision.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <tuple>

using fsdp::CollectiveKind;
using fsdp::testing::run_distributed;

namespace {

// ------------------------------------------------------------------------------ helpers

at::Tensor rng_state() { return at::detail::getDefaultCPUGenerator().get_state(); }

bool same_rng_state(const at::Tensor& a, const at::Tensor& b) { return at::equal(a, b); }

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// The whole gradient of a sharded parameter, gathered from every rank's shard (collective).
at::Tensor full_grad_of(const at::Tensor& sharded_param) {
  auto d = fsdp::as_dtensor(sharded_param);
  return fsdp::DTensor::from_local(sharded_param.grad(), d.device_mesh(), d.placements(), d.sizes()).full_tensor();
}

// Every gathered gradient of `model` equals `ref`'s (both sharded alike; collective).
void expect_same_sharded_grads(torch::nn::Module& model, torch::nn::Module& ref, const std::string& what) {
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << what << ": " << item.key();
    EXPECT_LT(max_diff(full_grad_of(item.value()), full_grad_of(ref_params[item.key()])), 1e-6)
        << what << ": " << item.key();
  }
}

void expect_same_grads(torch::nn::Module& model, torch::nn::Module& ref, const std::string& what) {
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << what << ": " << item.key();
    EXPECT_LT(max_diff(item.value().grad(), ref_params[item.key()].grad()), 1e-6) << what << ": " << item.key();
  }
}

struct Counts {
  int64_t forward_all_gathers, backward_all_gathers, backward_reduce_scatters;
};

// Runs forward (`forward` returns the loss) and backward, counting the collectives of each.
template <typename Forward>
Counts count_step(const std::shared_ptr<fsdp::ProcessGroup>& pg, Forward forward) {
  pg->reset_stats();
  at::Tensor loss = forward();
  const auto fwd = pg->stats();
  EXPECT_EQ(fwd[CollectiveKind::kReduceScatter].calls, 0);
  pg->reset_stats();
  loss.backward();
  const auto bwd = pg->stats();
  return {fwd[CollectiveKind::kAllGather].calls, bwd[CollectiveKind::kAllGather].calls,
          bwd[CollectiveKind::kReduceScatter].calls};
}

void expect_counts(const Counts& got, const Counts& want, const std::string& what) {
  if (fsdp::get_world_size() == 1) return;  // one rank: the shards are the parameters, nothing to gather
  EXPECT_EQ(got.forward_all_gathers, want.forward_all_gathers) << what;
  EXPECT_EQ(got.backward_all_gathers, want.backward_all_gathers) << what;
  EXPECT_EQ(got.backward_reduce_scatters, want.backward_reduce_scatters) << what;
}

// ------------------------------------------------------------------------------ the Transformer

fsdp::models::Transformer make_transformer(double dropout) {
  fsdp::models::ModelArgs args;  // tiny: 2 blocks
  args.dropout_p = dropout;
  torch::manual_seed(0);
  return fsdp::models::Transformer(args);
}

// The blocks with `reshard` after forward; the root with the default (it keeps its parameters).
void shard_transformer(fsdp::models::Transformer& model, const fsdp::DeviceMesh& mesh, bool reshard) {
  for (auto& block : model->blocks()) {
    fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh).reshard_after_forward(reshard));
  }
  fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
}

at::Tensor tokens(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step + 1000 * fsdp::get_rank());
  return at::randint(0, 8, {2, 16}, gen);
}

at::Tensor transformer_loss(fsdp::models::Transformer& model, const at::Tensor& toks) {
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
}

// ------------------------------------------------------------------------------ small models

// y = b(tanh(mid(tanh(a(pre(x)))))) where a and b compute with one shared weight; the test
// shards {a, b} together. `mode` picks what is checkpointed.
struct ProjImpl : torch::nn::Module {
  explicit ProjImpl(at::Tensor w) : weight(register_parameter("weight", std::move(w))) {}
  at::Tensor forward(const at::Tensor& x) { return at::matmul(x, weight.t()); }
  at::Tensor weight;
};
TORCH_MODULE(Proj);

enum class TiedMode { kPlain, kOneCheckpoint, kCheckpointEach };

struct TiedImpl : torch::nn::Module {
  explicit TiedImpl(TiedMode m) : mode(m) {
    torch::manual_seed(1);
    at::Tensor shared = at::randn({7, 7}) * 0.4;
    pre = register_module("pre", torch::nn::Linear(5, 7));
    a = register_module("a", Proj(shared));
    mid = register_module("mid", torch::nn::Linear(7, 7));
    b = register_module("b", Proj(shared));
  }
  at::Tensor body(const at::Tensor& h) { return fsdp::call(b, at::tanh(fsdp::call(mid, at::tanh(fsdp::call(a, h))))); }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = fsdp::call(pre, x);
    switch (mode) {
      case TiedMode::kPlain: return body(h);
      case TiedMode::kOneCheckpoint: return fsdp::checkpoint([this](const at::Tensor& in) { return body(in); }, h);
      case TiedMode::kCheckpointEach:
        h = at::tanh(fsdp::call(mid, at::tanh(fsdp::call_checkpointed(a, h))));
        return fsdp::call_checkpointed(b, h);
    }
    return at::Tensor();
  }
  TiedMode mode;
  torch::nn::Linear pre{nullptr}, mid{nullptr};
  Proj a{nullptr}, b{nullptr};
};
TORCH_MODULE(Tied);

// y = head(tanh(m(tanh(m(pre(x)))))): one FSDP module called twice before one backward. Every
// layer maps 7 features to 7, so m can also be called on y.
enum class TwiceMode { kPlain, kCheckpointEachCall, kOneCheckpoint };

struct TwiceImpl : torch::nn::Module {
  explicit TwiceImpl(TwiceMode mode_) : mode(mode_) {
    torch::manual_seed(2);
    pre = register_module("pre", torch::nn::Linear(5, 7));
    m = register_module("m", torch::nn::Linear(7, 7));
    head = register_module("head", torch::nn::Linear(7, 7));
  }
  at::Tensor twice(const at::Tensor& h) { return fsdp::call(m, at::tanh(fsdp::call(m, h))); }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = fsdp::call(pre, x);
    switch (mode) {
      case TwiceMode::kPlain: h = twice(h); break;
      case TwiceMode::kCheckpointEachCall:
        h = fsdp::call_checkpointed(m, at::tanh(fsdp::call_checkpointed(m, h)));
        break;
      case TwiceMode::kOneCheckpoint:
        h = fsdp::checkpoint([this](const at::Tensor& in) { return twice(in); }, h);
        break;
    }
    return fsdp::call(head, at::tanh(h));
  }
  TwiceMode mode;
  torch::nn::Linear pre{nullptr}, m{nullptr}, head{nullptr};
};
TORCH_MODULE(Twice);

at::Tensor small_input(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(50 + step + 1000 * fsdp::get_rank());
  return at::randn({3, 5}, gen);
}

}  // namespace

// Per-block checkpointing of the tiny Transformer (2 blocks + root) against the same sharded
// model without it, for reshard_after_forward true and false, with dropout (the RNG state) and
// with every other block checkpointed. Collectives per step (W > 1), the root never resharding
// after forward: forward all-gathers each of the 3 groups once; backward all-gathers each
// resharded block once — for a checkpointed block that one all-gather (prefetched by the group
// after it) serves the recomputation and its backward, so checkpointing adds none — and none
// without resharding; every group reduce-scatters once.
TEST(ActivationCheckpoint, TransformerMatchesUncheckpointedRunAndCountsCollectives) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      auto mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
      auto pg = mesh.get_group(0);
      struct Case {
        bool reshard;
        double dropout;
        int64_t every_k;
      };
      for (const Case c : {Case{true, 0.0, 1}, Case{false, 0.0, 1}, Case{true, 0.2, 1}, Case{true, 0.2, 2}}) {
        const std::string what = std::string("reshard_after_forward=") + (c.reshard ? "true" : "false") +
                                 " dropout=" + std::to_string(c.dropout) + " every_k=" + std::to_string(c.every_k);
        auto plain = make_transformer(c.dropout);
        auto ckpt = make_transformer(c.dropout);
        ckpt->set_activation_checkpointing(c.every_k);
        EXPECT_EQ(ckpt->is_block_checkpointed(0), c.every_k == 1) << what;
        EXPECT_TRUE(ckpt->is_block_checkpointed(1)) << what;
        shard_transformer(plain, mesh, c.reshard);
        shard_transformer(ckpt, mesh, c.reshard);
        torch::optim::SGD plain_opt(plain->parameters(), 0.1), ckpt_opt(ckpt->parameters(), 0.1);
        for (int64_t step = 0; step < 2; ++step) {  // step 1 also prefetches in forward
          plain_opt.zero_grad();
          ckpt_opt.zero_grad();
          torch::manual_seed(100 + step);
          at::Tensor plain_loss;
          const Counts plain_counts =
              count_step(pg, [&] { return plain_loss = transformer_loss(plain, tokens(step)); });
          const at::Tensor plain_rng = rng_state();
          torch::manual_seed(100 + step);
          at::Tensor ckpt_loss;
          const Counts counts = count_step(pg, [&] { return ckpt_loss = transformer_loss(ckpt, tokens(step)); });
          expect_counts(plain_counts, {3, c.reshard ? 2 : 0, 3}, what + " (without checkpointing)");
          expect_counts(counts, {3, c.reshard ? 2 : 0, 3}, what);
          EXPECT_TRUE(same_rng_state(rng_state(), plain_rng)) << what << ": the generator moved differently";
          EXPECT_LT(std::abs(ckpt_loss.item<double>() - plain_loss.item<double>()), 1e-6) << what;
          expect_same_sharded_grads(*ckpt, *plain, what + " step " + std::to_string(step));
          plain_opt.step();
          ckpt_opt.step();
        }
      }
    });
  }
}

// Shared weights, a module called twice, gradient accumulation, mixed precision and a
// checkpointed child called after the root's forward, each against the same run without
// checkpointing (W = 3: 7 rows pad to 3 + 3 + 1).
TEST(ActivationCheckpoint, TiedWeightsRepeatedCallsAccumulationMixedPrecisionAndLateChild) {
  run_distributed(3, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {3});
    auto pg = mesh.get_group(0);
    auto opts = fsdp::FullyShardOptions().mesh(mesh);

    // Shared weight, {a, b} sharded together. Plain: forward gathers {a, b} and the root;
    // backward gathers {a, b} once (the root's pre-backward prefetches it); {a, b} and the root
    // reduce once. One checkpoint over a..b is one round of the group in the recomputation: the
    // same counts. a and b checkpointed apart recompute in two backwards of their own: b's
    // reduces b's share and reshards, a's gathers again and reduces a's share (the shares add up
    // in the sharded gradient).
    std::vector<Tied> tied;
    for (TiedMode mode : {TiedMode::kPlain, TiedMode::kOneCheckpoint, TiedMode::kCheckpointEach}) {
      Tied model(mode);
      fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->a.ptr(), model->b.ptr()}, opts);
      fsdp::fully_shard(model, opts);
      Counts counts = count_step(pg, [&] { return fsdp::call(model, small_input(0)).pow(2).mean(); });
      const bool apart = mode == TiedMode::kCheckpointEach;
      expect_counts(counts, {2, apart ? 2 : 1, apart ? 3 : 2}, "tied mode " + std::to_string(tied.size()));
      tied.push_back(model);
    }
    expect_same_sharded_grads(*tied[1], *tied[0], "tied, one checkpoint");
    expect_same_sharded_grads(*tied[2], *tied[0], "tied, checkpointed apart");

    // m called twice. Plain: forward gathers the root and m twice; backward gathers m for each
    // call's backward (the second call's prefetched by the root). m reduces once: autograd adds
    // up a parameter's gradient from both calls before accumulating it, so the second call's
    // post-backward finds none yet and only reshards, and the first call's reduces it all; the
    // root reduces too. Each call checkpointed: each recomputation's backward accumulates m's
    // gradient on its own, so m reduces per call. Both calls in one checkpoint: one round in the
    // recomputation, so m stays gathered through both calls and reduces once.
    std::vector<Twice> twice;
    for (TwiceMode mode : {TwiceMode::kPlain, TwiceMode::kCheckpointEachCall, TwiceMode::kOneCheckpoint}) {
      Twice model(mode);
      fsdp::fully_shard(model->m, opts);
      fsdp::fully_shard(model, opts);
      Counts counts = count_step(pg, [&] { return fsdp::call(model, small_input(1)).pow(2).mean(); });
      const bool one = mode == TwiceMode::kOneCheckpoint;
      const bool each = mode == TwiceMode::kCheckpointEachCall;
      expect_counts(counts, {3, one ? 1 : 2, each ? 3 : 2}, "twice mode " + std::to_string(twice.size()));
      twice.push_back(model);
    }
    expect_same_sharded_grads(*twice[1], *twice[0], "twice, each call checkpointed");
    expect_same_sharded_grads(*twice[2], *twice[0], "twice, one checkpoint");

    // Gradient accumulation: two micro-batches, the first without reduce-scatter.
    auto plain = make_transformer(0.1), ckpt = make_transformer(0.1);
    ckpt->set_activation_checkpointing(1);
    for (auto* model : {&plain, &ckpt}) {
      shard_transformer(*model, mesh, true);
      auto handle = fsdp::get_fsdp_module(**model);
      for (int64_t micro = 0; micro < 2; ++micro) {
        handle.set_requires_gradient_sync(micro == 1);
        torch::manual_seed(200 + micro);
        Counts counts = count_step(pg, [&] { return transformer_loss(*model, tokens(10 + micro)); });
        expect_counts(counts, {3, 2, micro == 1 ? 3 : 0}, "accumulation micro-batch " + std::to_string(micro));
      }
    }
    expect_same_sharded_grads(*ckpt, *plain, "gradient accumulation");

    // Mixed precision (bf16 compute, fp32 reduction): the recomputation casts as the forward did.
    auto bf16 = fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    std::vector<fsdp::models::Transformer> mixed;
    for (int64_t every_k : {0, 1}) {
      auto model = make_transformer(0.0);
      model->set_activation_checkpointing(every_k);
      for (auto& block : model->blocks()) {
        fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh).mp_policy(bf16));
      }
      fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh).mp_policy(bf16));
      transformer_loss(model, tokens(20)).backward();
      mixed.push_back(model);
    }
    expect_same_sharded_grads(*mixed[1], *mixed[0], "mixed precision");

    // A child called on its own after the root's forward, inside a checkpoint: its recomputed
    // backward comes first, so its pre-backward queues the end-of-backward work from inside the
    // nested backward. That work must wait for the outer backward: otherwise it would reshard
    // the root and finish the iteration early, and the root's backward would gather again.
    // Backward: the third call's backward (recomputed or not) gathers m; the root's pre-backward
    // prefetches m for the second call's, the first call's gathers again. m reduces after the
    // first call (with the third call's gradient too when that is not checkpointed, as above)
    // and, checkpointed, after the recomputed third call; the root reduces once.
    std::vector<Twice> late;
    for (bool checkpointed : {false, true}) {
      Twice model(TwiceMode::kPlain);
      fsdp::fully_shard(model->m, opts);
      fsdp::fully_shard(model, opts);
      Counts counts = count_step(pg, [&] {
        at::Tensor h = at::tanh(fsdp::call(model, small_input(2)));
        h = checkpointed ? fsdp::call_checkpointed(model->m, h) : fsdp::call(model->m, h);
        return h.pow(2).mean();
      });
      // Forward: the root, m in the root's forward (both calls: m reshards after each), m alone.
      expect_counts(counts, {4, 3, checkpointed ? 3 : 2},
                    std::string("late child, checkpointed=") + (checkpointed ? "1" : "0"));
      late.push_back(model);
    }
    expect_same_sharded_grads(*late[1], *late[0], "late child");
  });
}

// Without FSDP: a plain module and lambdas (several outputs, a non-tensor argument, an unused
// output), dropout, the options, and the memory kept.
TEST(ActivationCheckpoint, PlainModulesLambdasAndOptions) {
  torch::manual_seed(3);
  torch::nn::Linear plain(6, 4), ckpt(6, 4);
  {
    torch::NoGradGuard no_grad;
    ckpt->weight.copy_(plain->weight);
    ckpt->bias.copy_(plain->bias);
  }
  at::Tensor x = at::randn({5, 6}).requires_grad_();
  at::Tensor x2 = x.detach().clone().requires_grad_();
  at::Tensor y_plain = fsdp::call(plain, x);
  at::Tensor y_ckpt = fsdp::call_checkpointed(ckpt, x2);
  EXPECT_TRUE(at::equal(y_plain, y_ckpt));
  ASSERT_TRUE(y_ckpt.requires_grad());
  y_plain.pow(2).sum().backward();
  y_ckpt.pow(2).sum().backward();
  expect_same_grads(*ckpt, *plain, "linear");
  EXPECT_LT(max_diff(x2.grad(), x.grad()), 1e-6);

  // A lambda with a non-tensor argument and a tuple result whose second tensor is not used.
  auto f = [](const at::Tensor& a, double scale, const at::Tensor& b) {
    return std::make_tuple(at::tanh(a * scale) * b, at::sigmoid(b));
  };
  at::Tensor a1 = at::randn({4}).requires_grad_(), b1 = at::randn({4}).requires_grad_();
  at::Tensor a2 = a1.detach().clone().requires_grad_(), b2 = b1.detach().clone().requires_grad_();
  std::get<0>(f(a1, 1.5, b1)).sum().backward();
  auto [out, unused] = fsdp::checkpoint(f, a2, 1.5, b2);
  EXPECT_TRUE(unused.requires_grad());
  out.sum().backward();
  EXPECT_LT(max_diff(a2.grad(), a1.grad()), 1e-6);
  EXPECT_LT(max_diff(b2.grad(), b1.grad()), 1e-6);

  // Dropout: the recomputation draws the forward's mask, and the generator ends where it would.
  auto dropped = [](const at::Tensor& t) { return at::dropout(at::tanh(t), 0.5, /*train=*/true) * 3.0; };
  at::Tensor d1 = at::randn({64}).requires_grad_(), d2 = d1.detach().clone().requires_grad_();
  at::Tensor d3 = d1.detach().clone().requires_grad_();
  torch::manual_seed(7);
  dropped(d1).sum().backward();
  const at::Tensor rng_after_plain = rng_state();
  torch::manual_seed(7);
  fsdp::checkpoint(dropped, d2).sum().backward();
  EXPECT_TRUE(same_rng_state(rng_state(), rng_after_plain));
  EXPECT_LT(max_diff(d2.grad(), d1.grad()), 1e-6);
  torch::manual_seed(7);
  fsdp::checkpoint(fsdp::CheckpointOptions().preserve_rng_state(false), dropped, d3).sum().backward();
  EXPECT_GT(max_diff(d3.grad(), d1.grad()), 0.1) << "without the saved state the recomputation draws a new mask";

  // Non-reentrant checkpointing is refused, saying why and what to use.
  try {
    fsdp::checkpoint(fsdp::CheckpointOptions().use_reentrant(false), dropped, d2);
    ADD_FAILURE() << "use_reentrant(false) was accepted";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("saved-tensor hooks"), std::string::npos) << msg;
    EXPECT_NE(msg.find("use_reentrant(true)"), std::string::npos) << msg;
  }

  auto model = make_transformer(0.0);
  EXPECT_THROW(model->set_activation_checkpointing(1, fsdp::CheckpointOptions().use_reentrant(false)), c10::Error)
      << "refused when set, not at the first forward";
  EXPECT_THROW(model->set_activation_checkpointing(-1), c10::Error);
  EXPECT_NO_THROW(model->set_activation_checkpointing(0, fsdp::CheckpointOptions().use_reentrant(false)));

  // torch::autograd::grad through a checkpoint is refused (the recomputation would fill .grad).
  at::Tensor g_in = at::randn({4}).requires_grad_();
  at::Tensor g_out = fsdp::checkpoint([](const at::Tensor& t) { return at::tanh(t); }, g_in).sum();
  EXPECT_THROW(torch::autograd::grad({g_out}, {g_in}), c10::Error);

  // Under no-grad it is the plain call.
  {
    torch::NoGradGuard no_grad;
    at::Tensor r = fsdp::call_checkpointed(ckpt, x2);
    EXPECT_FALSE(r.requires_grad());
    EXPECT_TRUE(at::equal(r, y_plain.detach()));
  }

  // Memory: the 8 intermediate [256, 256] tensors (256 KiB each) of a tanh chain are kept by a
  // plain forward and freed by a checkpointed one.
  ASSERT_TRUE(fsdp::memory::tracking_allocator_installed());
  auto chain = [](const at::Tensor& t) {
    at::Tensor h = t;
    for (int i = 0; i < 8; ++i) h = at::tanh(h);
    return h;
  };
  at::Tensor big = at::randn({256, 256}).requires_grad_();
  const int64_t before = fsdp::memory::allocated_bytes();
  at::Tensor kept = chain(big);
  const int64_t plain_bytes = fsdp::memory::allocated_bytes() - before;
  kept = at::Tensor();
  const int64_t before_ckpt = fsdp::memory::allocated_bytes();
  at::Tensor recomputed = fsdp::checkpoint(chain, big);
  const int64_t ckpt_bytes = fsdp::memory::allocated_bytes() - before_ckpt;
  const int64_t tensor_bytes = 256 * 256 * 4;
  EXPECT_GE(plain_bytes, 8 * tensor_bytes);
  EXPECT_LE(ckpt_bytes, 2 * tensor_bytes) << "only the output (and the generator state) is kept";
  recomputed.sum().backward();
  at::Tensor big2 = big.detach().clone().requires_grad_();
  chain(big2).sum().backward();
  EXPECT_LT(max_diff(big.grad(), big2.grad()), 1e-6);
}
