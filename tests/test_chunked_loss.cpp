// TransformerImpl::forward_loss (fsdp/models/transformer.h): the loss computed a piece of the
// sequence at a time, each piece's head and cross-entropy checkpointed, equals the loss of the
// whole logits, and so do the gradients, unsharded and under fully_shard (called through
// fsdp::call_method, which runs the root's hooks as fsdp::call does), with and without
// activation checkpointing of the blocks.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

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

// Unsharded: 1 piece is the whole-logits loss bitwise; 2, 3 (16 = 6 + 5 + 5), 5 and 16 pieces
// agree within 1e-6, with dropout in the blocks (the pieces draw no random numbers, so the
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
      const std::string what = "dropout=" + std::to_string(c.dropout) + " every_k=" +
                               std::to_string(c.checkpoint_every_k) + " ignore=" + std::to_string(c.ignore_some) +
                               " chunks=" + std::to_string(chunks);
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

// Pieces are checkpointed, so forward keeps none of a piece's logits: with 16 pieces the peak of
// the forward is well under the whole logits' (2 x 16 x 32000 fp32 = 4 MiB, a vocabulary large
// enough to dominate).
TEST(ChunkedLoss, ForwardKeepsOnePiecesLogitsAtATime) {
  fsdp::models::ModelArgs args;
  args.vocab_size = 32000, args.dropout_p = 0;
  torch::manual_seed(0);
  Transformer model(args);
  const at::Tensor toks = at::randint(0, args.vocab_size, {2, kSeq});
  auto forward_peak_above_start = [&](int64_t chunks) {
    const int64_t start = fsdp::memory::allocated_bytes();
    fsdp::memory::reset_peak_allocated();
    at::Tensor loss = chunked_loss(model, toks, targets_of(toks), chunks);
    const int64_t peak = fsdp::memory::max_allocated_bytes() - start;
    loss.backward();
    model->zero_grad();
    return peak;
  };
  const int64_t logits_bytes = 2 * kSeq * args.vocab_size * 4;
  const int64_t whole = forward_peak_above_start(1);
  const int64_t pieces = forward_peak_above_start(16);
  EXPECT_GE(whole, 2 * logits_bytes);  // logits and the log-softmax the loss saves
  EXPECT_LT(pieces, logits_bytes / 2) << "whole: " << whole;
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
                               " every_k=" + std::to_string(c.checkpoint_every_k) + " chunks=" + std::to_string(c.chunks);
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
        const Counts counts = count_step(pg, got, [&] { return chunked_loss(model, toks, targets_of(toks), c.chunks); });
        EXPECT_TRUE(counts == ref_counts) << what << ": all-gathers " << counts.forward_all_gathers << "/"
                                          << counts.backward_all_gathers << ", reduce-scatters "
                                          << counts.backward_reduce_scatters;
        EXPECT_EQ(counts.backward_reduce_scatters, 3) << what;
        EXPECT_LT(std::abs(got.item<double>() - want.item<double>()), 1e-6) << what << " step " << step;
        expect_same_grads(*model, *ref, /*sharded=*/true, what + " step " + std::to_string(step));
        ref_opt.step();
        opt.step();
      }
    }
  });
}
