// TransformerImpl::forward_loss (fsdp/models/transformer.h) and the function under it,
// chunked_linear_cross_entropy (fsdp/models/linear_cross_entropy.h): the loss computed a piece of
// the rows at a time, the head and cross-entropy one autograd node, equals the loss of the whole
// logits, and so do the gradients, unsharded and under fully_shard (called through
// fsdp::call_method, which runs the root's hooks as fsdp::call does), with and without
// activation checkpointing of the blocks, and with the final norm and output head as an FSDP
// group of their own (sharded_transformer's head_options), which gathers and reduces once per
// step and is freed before the blocks' backward.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/linear_cross_entropy.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <optional>
#include <string>

using fsdp::CollectiveKind;
using fsdp::models::Transformer;
using fsdp::models::TransformerImpl;
using fsdp::testing::run_distributed;

namespace {

constexpr int64_t kSeq = 16, kVocab = 8;

Transformer make_transformer(double dropout, int64_t checkpoint_every_k) {
  fsdp::models::ModelArgs args;  // tiny: 2 blocks, vocab 8, max_seq_len 16
  args.dropout_p = dropout;
  torch::manual_seed(0);
  Transformer model(args);
  model->set_activation_checkpointing(checkpoint_every_k);
  return model;
}

at::Tensor tokens(int64_t step) {
  const int64_t rank = fsdp::is_initialized() ? fsdp::get_rank() : 0;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step + 1000 * rank);
  return at::randint(0, kVocab, {2, kSeq}, gen);
}

at::Tensor targets_of(const at::Tensor& toks) { return toks.roll(-1, 1); }

// The loss of the whole logits, as the trainer computed it before forward_loss.
at::Tensor whole_logits_loss(Transformer& model, const at::Tensor& toks, const at::Tensor& targets) {
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), targets.reshape({-1}));
}

at::Tensor chunked_loss(Transformer& model, const at::Tensor& toks, const at::Tensor& targets, int64_t chunks) {
  return fsdp::call_method(model, &TransformerImpl::forward_loss, toks, targets, chunks);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// The whole gradient of a sharded parameter, gathered from every rank's shard (collective).
at::Tensor full_grad_of(const at::Tensor& sharded_param) {
  auto d = fsdp::as_dtensor(sharded_param);
  return fsdp::DTensor::from_local(sharded_param.grad(), d.device_mesh(), d.placements(), d.sizes()).full_tensor();
}

void expect_same_grads(torch::nn::Module& model, torch::nn::Module& ref, bool sharded, const std::string& what) {
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << what << ": " << item.key();
    const at::Tensor got = sharded ? full_grad_of(item.value()) : item.value().grad();
    const at::Tensor want = sharded ? full_grad_of(ref_params[item.key()]) : ref_params[item.key()].grad();
    EXPECT_LT(max_diff(got, want), 1e-6) << what << ": " << item.key();
  }
}

struct Counts {
  int64_t forward_all_gathers, backward_all_gathers, backward_reduce_scatters;
  bool operator==(const Counts& o) const {
    return forward_all_gathers == o.forward_all_gathers && backward_all_gathers == o.backward_all_gathers &&
           backward_reduce_scatters == o.backward_reduce_scatters;
  }
};

// Forward (`forward` returns the loss) and backward, counting the collectives of each.
template <typename Forward>
Counts count_step(const std::shared_ptr<fsdp::ProcessGroup>& pg, at::Tensor& loss, Forward forward) {
  pg->reset_stats();
  loss = forward();
  const auto fwd = pg->stats();
  pg->reset_stats();
  loss.backward();
  const auto bwd = pg->stats();
  return {fwd[CollectiveKind::kAllGather].calls, bwd[CollectiveKind::kAllGather].calls,
          bwd[CollectiveKind::kReduceScatter].calls};
}

}  // namespace

// Unsharded: 1 piece is the whole-logits loss bitwise; 2, 3 (32 rows = 11 + 11 + 10), 5 and 16
// pieces agree within 1e-6, with dropout in the blocks (the pieces draw no random numbers, so the
// generator moves as without them), with checkpointed blocks, with ignored targets (-100, which
// the mean leaves out as cross_entropy does), and under no-grad.
TEST(ChunkedLoss, EqualsTheWholeLogitsLossAndGradsUnsharded) {
  struct Case {
    double dropout;
    int64_t checkpoint_every_k;
    bool ignore_some;
  };
  for (const Case c : {Case{0.0, 0, false}, Case{0.1, 0, false}, Case{0.1, 1, false}, Case{0.0, 2, true}}) {
    for (int64_t chunks : {1, 2, 3, 5, 16}) {
      const std::string what = "dropout=" + std::to_string(c.dropout) +
                               " every_k=" + std::to_string(c.checkpoint_every_k) +
                               " ignore=" + std::to_string(c.ignore_some) + " chunks=" + std::to_string(chunks);
      auto ref = make_transformer(c.dropout, c.checkpoint_every_k);
      auto model = make_transformer(c.dropout, c.checkpoint_every_k);
      const at::Tensor toks = tokens(0);
      at::Tensor targets = targets_of(toks);
      if (c.ignore_some) targets.index_put_({0, at::indexing::Slice(3, 9)}, -100);

      torch::manual_seed(5);
      at::Tensor want = whole_logits_loss(ref, toks, targets);
      want.backward();
      const at::Tensor rng_after_ref = at::detail::getDefaultCPUGenerator().get_state();
      torch::manual_seed(5);
      at::Tensor got = chunked_loss(model, toks, targets, chunks);
      got.backward();
      EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), rng_after_ref)) << what;

      EXPECT_EQ(got.scalar_type(), at::kFloat) << what;
      EXPECT_EQ(got.dim(), 0) << what;
      if (chunks == 1) {
        EXPECT_TRUE(at::equal(got, want)) << what;
      }
      EXPECT_LT(std::abs(got.item<double>() - want.item<double>()), 1e-6) << what;
      expect_same_grads(*model, *ref, /*sharded=*/false, what);

      model->eval();  // no-grad evaluation: the pieces are computed directly
      ref->eval();
      at::NoGradGuard no_grad;
      EXPECT_LT(std::abs(chunked_loss(model, toks, targets, chunks).item<double>() -
                         whole_logits_loss(ref, toks, targets).item<double>()),
                1e-6)
          << what << " (eval, no-grad)";
    }
  }
}

// Forward keeps only each row's log-sum-exp, backward recomputes one piece's logits at a time:
// with 16 pieces the peak of forward and of backward is well under the whole logits' (2 x 16 x
// 32000 fp32 = 4 MiB, a vocabulary large enough to dominate).
TEST(ChunkedLoss, ForwardAndBackwardKeepOnePiecesLogitsAtATime) {
  fsdp::models::ModelArgs args;
  args.vocab_size = 32000, args.dropout_p = 0;
  torch::manual_seed(0);
  Transformer model(args);
  const at::Tensor toks = at::randint(0, args.vocab_size, {2, kSeq});
  struct Peaks {
    int64_t forward, backward;
  };
  auto peaks_above_start = [&](int64_t chunks) {
    const int64_t start = fsdp::memory::allocated_bytes();
    fsdp::memory::reset_peak_allocated();
    at::Tensor loss = chunked_loss(model, toks, targets_of(toks), chunks);
    const int64_t forward = fsdp::memory::max_allocated_bytes() - start;
    const int64_t before_backward = fsdp::memory::allocated_bytes();
    fsdp::memory::reset_peak_allocated();
    loss.backward();
    const int64_t backward = fsdp::memory::max_allocated_bytes() - before_backward;
    model->zero_grad();
    return Peaks{forward, backward};
  };
  peaks_above_start(1);  // the gradients exist from here on, in both measurements
  const int64_t logits_bytes = 2 * kSeq * args.vocab_size * 4;
  const Peaks whole = peaks_above_start(1);
  const Peaks pieces = peaks_above_start(16);
  EXPECT_GE(whole.forward, 2 * logits_bytes);  // logits and the log-softmax the loss saves
  EXPECT_LT(pieces.forward, logits_bytes / 2) << "whole: " << whole.forward;
  EXPECT_GE(whole.backward, logits_bytes);  // the logits' gradient, whole
  EXPECT_LT(pieces.backward + logits_bytes / 2, whole.backward) << "pieces: " << pieces.backward;
}

// The function itself, with x and the weight in double and in float, against cross_entropy(sum)
// of the whole fp32 logits: the loss (an fp32 sum of 31 rows, so within 1e-6 of its size) and
// both gradients (within 1e-6), with ignored rows, for 1 to one-per-row pieces, and with a
// leading batch shape.
TEST(ChunkedLoss, LinearCrossEntropyEqualsCrossEntropyOfTheWholeLogits) {
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const at::Tensor x0 = at::randn({5, 7, 12}, gen, at::TensorOptions().dtype(dtype));
    const at::Tensor w0 = at::randn({33, 12}, gen, at::TensorOptions().dtype(dtype)) * 0.5;
    at::Tensor targets = at::randint(0, 33, {5, 7}, gen);
    targets.index_put_({1, at::indexing::Slice(2, 6)}, -100);
    const at::Tensor x_ref = x0.clone().requires_grad_(), w_ref = w0.clone().requires_grad_();
    const at::Tensor want = torch::nn::functional::cross_entropy(
        at::linear(x_ref, w_ref).to(at::kFloat).reshape({-1, 33}), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    (want * 0.7).backward();
    const double tol = 1e-6 * want.abs().item<double>();
    for (int64_t chunks : {1, 2, 6, 35}) {
      const std::string what = std::string(c10::toString(dtype)) + " chunks=" + std::to_string(chunks);
      const at::Tensor x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_();
      const at::Tensor got = fsdp::models::chunked_linear_cross_entropy(x, w, targets, chunks);
      EXPECT_EQ(got.scalar_type(), at::kFloat) << what;
      EXPECT_LT(std::abs(got.item<double>() - want.item<double>()), tol) << what;
      (got * 0.7).backward();
      EXPECT_EQ(x.grad().scalar_type(), dtype) << what;
      EXPECT_LT(max_diff(x.grad(), x_ref.grad()), 1e-6) << what;
      EXPECT_LT(max_diff(w.grad(), w_ref.grad()), 1e-6) << what;
      EXPECT_TRUE(at::equal(x.grad()[1].narrow(0, 2, 4), at::zeros({4, 12}, x.grad().options()))) << what;
    }
  }
}

TEST(ChunkedLoss, LinearCrossEntropyRefusesBadArguments) {
  const at::Tensor x = at::randn({4, 6}), w = at::randn({9, 6});
  const at::Tensor t = at::randint(0, 9, {4});
  auto expect_error = [](const std::function<void()>& f, const std::string& want) {
    try {
      f();
      ADD_FAILURE() << "accepted; expected: " << want;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  using fsdp::models::chunked_linear_cross_entropy;
  expect_error([&] { chunked_linear_cross_entropy(x, w, t, 0); }, "chunks=0 must be in [1, 4]");
  expect_error([&] { chunked_linear_cross_entropy(x, w, t, 5); }, "chunks=5 must be in [1, 4]");
  expect_error(
      [&] {
        chunked_linear_cross_entropy(x, at::randn({9, 5}), t, 1);
      },
      "x has shape [4, 6] and weight [9, 5]");
  expect_error([&] { chunked_linear_cross_entropy(x, w.to(at::kDouble), t, 1); },
               "x is Float and weight Double; give both the same floating dtype");
  expect_error([&] { chunked_linear_cross_entropy(x, w, t.narrow(0, 0, 3), 1); },
               "targets are Long of shape [3]; give int64 class indices of x's leading shape [4]");
}

TEST(ChunkedLoss, RefusesBadPiecesAndTargets) {
  auto model = make_transformer(0.0, 0);
  const at::Tensor toks = tokens(0);
  for (int64_t chunks : {int64_t{0}, int64_t{-1}, kSeq + 1}) {
    try {
      chunked_loss(model, toks, targets_of(toks), chunks);
      ADD_FAILURE() << "chunks=" << chunks << " was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("forward_loss: chunks=" + std::to_string(chunks) + " must be in [1, 16]"),
                std::string::npos)
          << e.what();
    }
  }
  try {
    chunked_loss(model, toks, targets_of(toks).narrow(1, 0, 8), 2);
    ADD_FAILURE() << "targets of another shape were accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("forward_loss: targets have shape [2, 8] but tokens [2, 16]"),
              std::string::npos)
        << e.what();
  }
}

// Under fully_shard at W = 2 (blocks resharding after forward or not, the root keeping its
// parameters), with and without checkpointed blocks, over two SGD steps: the loss and every
// gathered gradient equal the whole-logits run's within 1e-6, and the collectives are the same
// ones (the pieces reuse the root's gathered parameters; the root reduce-scatters once).
TEST(ChunkedLoss, EqualsTheWholeLogitsLossAndGradsUnderFullyShardAtTwoRanks) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto pg = mesh.get_group(0);
    struct Case {
      bool reshard;
      int64_t checkpoint_every_k;
      int64_t chunks;
    };
    for (const Case c : {Case{true, 0, 4}, Case{true, 1, 3}, Case{false, 1, 5}, Case{true, 2, 16}}) {
      const std::string what = std::string("reshard=") + (c.reshard ? "true" : "false") +
                               " every_k=" + std::to_string(c.checkpoint_every_k) +
                               " chunks=" + std::to_string(c.chunks);
      auto ref = make_transformer(0.1, c.checkpoint_every_k);
      auto model = make_transformer(0.1, c.checkpoint_every_k);
      for (Transformer* m : {&ref, &model}) {
        for (auto& block : (*m)->blocks())
          fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh).reshard_after_forward(c.reshard));
        fsdp::fully_shard(*m, fsdp::FullyShardOptions().mesh(mesh));
      }
      torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
      for (int64_t step = 0; step < 2; ++step) {
        const at::Tensor toks = tokens(step);
        ref_opt.zero_grad();
        opt.zero_grad();
        at::Tensor want, got;
        torch::manual_seed(40 + step);
        const Counts ref_counts = count_step(pg, want, [&] { return whole_logits_loss(ref, toks, targets_of(toks)); });
        torch::manual_seed(40 + step);
        const Counts counts =
            count_step(pg, got, [&] { return chunked_loss(model, toks, targets_of(toks), c.chunks); });
        EXPECT_TRUE(counts == ref_counts)
            << what << ": all-gathers " << counts.forward_all_gathers << "/" << counts.backward_all_gathers
            << ", reduce-scatters " << counts.backward_reduce_scatters;
        EXPECT_EQ(counts.backward_reduce_scatters, 3) << what;
        EXPECT_LT(std::abs(got.item<double>() - want.item<double>()), 1e-6) << what << " step " << step;
        expect_same_grads(*model, *ref, /*sharded=*/true, what + " step " + std::to_string(step));
        ref_opt.step();
        opt.step();
      }
    }
  });
}

namespace {

// Tiny, every block resharding after forward and checkpointed; the root keeps its parameters.
// With head_reshard set, the final norm and output head are a group of their own resharding
// after forward as told (sharded_transformer's head_options form).
Transformer sharded_tiny(const fsdp::DeviceMesh& mesh, std::optional<bool> head_reshard,
                         const fsdp::MixedPrecisionPolicy& mp = fsdp::MixedPrecisionPolicy()) {
  fsdp::models::ModelArgs args;
  args.dropout_p = 0.1;
  torch::manual_seed(0);
  const auto block_options = fsdp::FullyShardOptions().mesh(mesh).reshard_after_forward(true).mp_policy(mp);
  const auto root_options = fsdp::FullyShardOptions().mesh(mesh).mp_policy(mp);
  Transformer model =
      head_reshard ? fsdp::models::sharded_transformer(
                         args, block_options,
                         fsdp::FullyShardOptions(block_options).reshard_after_forward(*head_reshard), root_options)
                   : fsdp::models::sharded_transformer(args, block_options, root_options);
  model->set_activation_checkpointing(1);
  return model;
}

// What rank 0 sees of the head when the backward reaches the last block (its first gradient
// there): whether the head's gathered weight was freed and its unsharded gradient handed on,
// and how many reduce-scatters the backward had issued by then.
struct AtBlocksBackward {
  bool seen = false;
  bool head_weight_freed = false;
  bool head_grad_handed_on = false;
  int64_t reduce_scatters = 0;
};

}  // namespace

// The final norm and output head as an FSDP group of their own, with the loss in pieces, at
// W = 1..4 over two SGD steps: the loss and every gathered gradient equal those of the usual
// sharding with the whole logits within 1e-6. The head group gathers once in forward and, when
// it reshards after forward, once more in backward, and reduce-scatters once; its reduce-scatter
// is issued, and its gathered weight and unsharded gradient freed, before the blocks' backward
// starts (where the peak of a checkpointed model is). At one rank nothing is gathered or
// reduced, so the counts are the usual sharding's.
TEST(ChunkedLoss, HeadGroupEqualsTheWholeLogitsRunAndIsFreedBeforeTheBlocksBackwardAtOneToFourRanks) {
  for (int world = 1; world <= 4; ++world) {
    run_distributed(world, [world] {
      auto mesh = fsdp::init_device_mesh("cpu", {world});
      auto pg = mesh.get_group(0);
      for (const bool head_reshard : {false, true}) {
        const std::string what =
            "W=" + std::to_string(world) + " head reshard_after_forward=" + (head_reshard ? "true" : "false");
        auto ref = sharded_tiny(mesh, std::nullopt);
        auto model = sharded_tiny(mesh, head_reshard);
        AtBlocksBackward at_blocks;
        at::Tensor last_block_weight = model->blocks().back()->feed_forward->w2->weight;  // the gathered one
        last_block_weight.register_hook([&](const at::Tensor&) {
          if (at_blocks.seen) return;
          at_blocks.seen = true;
          at_blocks.head_weight_freed = model->output->weight.storage().nbytes() == 0;
          at_blocks.head_grad_handed_on = !model->output->weight.grad().defined();
          at_blocks.reduce_scatters = pg->stats()[CollectiveKind::kReduceScatter].calls;
        });
        torch::optim::SGD ref_opt(ref->parameters(), 0.1), opt(model->parameters(), 0.1);
        for (int64_t step = 0; step < 2; ++step) {
          const at::Tensor toks = tokens(step);
          ref_opt.zero_grad();
          opt.zero_grad();
          at::Tensor want, got;
          torch::manual_seed(40 + step);
          const Counts ref_counts =
              count_step(pg, want, [&] { return whole_logits_loss(ref, toks, targets_of(toks)); });
          torch::manual_seed(40 + step);
          at_blocks = AtBlocksBackward{};
          const Counts counts = count_step(pg, got, [&] { return chunked_loss(model, toks, targets_of(toks), 3); });
          const std::string at_step = what + " step " + std::to_string(step);
          if (world == 1) {
            EXPECT_TRUE(counts == ref_counts) << at_step;
          } else {
            EXPECT_EQ(counts.forward_all_gathers, ref_counts.forward_all_gathers + 1) << at_step;
            EXPECT_EQ(counts.backward_all_gathers, ref_counts.backward_all_gathers + (head_reshard ? 1 : 0)) << at_step;
            EXPECT_EQ(counts.backward_reduce_scatters, ref_counts.backward_reduce_scatters + 1) << at_step;
            EXPECT_EQ(counts.backward_reduce_scatters, 4) << at_step;  // 2 blocks, the head, the root
            ASSERT_TRUE(at_blocks.seen) << at_step;
            EXPECT_EQ(at_blocks.reduce_scatters, 1) << at_step << ": only the head's before the blocks' backward";
            EXPECT_TRUE(at_blocks.head_weight_freed) << at_step;
            EXPECT_TRUE(at_blocks.head_grad_handed_on) << at_step;
          }
          EXPECT_LT(std::abs(got.item<double>() - want.item<double>()), 1e-6) << at_step;
          expect_same_grads(*model, *ref, /*sharded=*/true, at_step);
          ref_opt.step();
          opt.step();
        }
      }
    });
  }
}

// Gradient accumulation (two micro-batches, the first without gradient sync, so the head group
// keeps its unsharded gradient across them and reduce-scatters once) and mixed precision (bf16
// compute, fp32 reduction: the head's matmuls in bf16, its softmax and loss in fp32) at W = 2,
// against the usual sharding with the whole logits under the same settings. fp32 accumulation
// agrees within 1e-6; bf16 within bf16's rounding of the pieces' sums.
TEST(ChunkedLoss, HeadGroupWithGradientAccumulationAndMixedPrecisionAtTwoRanks) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto pg = mesh.get_group(0);
    const auto bf16 = fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    for (const bool mixed : {false, true}) {
      const std::string what = mixed ? "bf16" : "fp32";
      const fsdp::MixedPrecisionPolicy mp = mixed ? bf16 : fsdp::MixedPrecisionPolicy();
      auto ref = sharded_tiny(mesh, std::nullopt, mp);
      auto model = sharded_tiny(mesh, /*head_reshard=*/true, mp);
      auto ref_root = fsdp::get_fsdp_module(*ref), root = fsdp::get_fsdp_module(*model);
      int64_t reduce_scatters = 0;
      double want_loss = 0, got_loss = 0;
      for (int64_t micro = 0; micro < 2; ++micro) {
        ref_root.set_requires_gradient_sync(micro == 1);
        root.set_requires_gradient_sync(micro == 1);
        const at::Tensor toks = tokens(micro);
        torch::manual_seed(60 + micro);
        at::Tensor want = whole_logits_loss(ref, toks, targets_of(toks)) / 2.0;
        want.backward();
        torch::manual_seed(60 + micro);
        pg->reset_stats();
        at::Tensor got = chunked_loss(model, toks, targets_of(toks), 4) / 2.0;
        got.backward();
        reduce_scatters += pg->stats()[CollectiveKind::kReduceScatter].calls;
        want_loss += want.item<double>();
        got_loss += got.item<double>();
      }
      EXPECT_EQ(reduce_scatters, 4) << what << ": one per group, after the last micro-batch";
      EXPECT_LT(std::abs(got_loss - want_loss), mixed ? 1e-2 : 1e-6) << what;
      auto ref_params = ref->named_parameters();
      for (const auto& item : model->named_parameters()) {
        const at::Tensor got = full_grad_of(item.value()), want = full_grad_of(ref_params[item.key()]);
        EXPECT_EQ(got.scalar_type(), at::kFloat) << what << ": " << item.key();
        const double tol = mixed ? 2e-2 * std::max(1.0, want.abs().max().item<double>()) : 1e-6;
        EXPECT_LT(max_diff(got, want), tol) << what << ": " << item.key();
      }
    }
  });
}
