// FullyShardOptions::quantized_weights and quantized_gradients across real processes: the bytes
// the shard and replicate groups move, what every rank computes with (the same decoded weights on
// every rank; gradients the same on every replica and near the exact mean), error feedback over
// steps, a short training against the fp32 run, and the refusals.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <string>
#include <vector>

using fsdp::CollectiveKind;
using fsdp::QuantizedComm;
using fsdp::QuantizedDtype;
using fsdp::ReduceOp;
using fsdp::testing::run_distributed;

namespace {

constexpr int64_t kGlobalRows = 8;

fsdp::models::Transformer make_transformer() {
  torch::manual_seed(0);
  fsdp::models::ModelArgs a;
  a.dropout_p = 0.0;
  return fsdp::models::Transformer(a);
}

std::vector<fsdp::FSDPModule> shard(fsdp::models::Transformer& m, const fsdp::FullyShardOptions& opts) {
  std::vector<fsdp::FSDPModule> handles;
  for (auto& block : m->blocks()) handles.push_back(fsdp::fully_shard(block, opts));
  handles.push_back(fsdp::fully_shard(m, opts));
  return handles;
}

// This data-parallel rank's rows of the step's global batch (every rank is one).
at::Tensor loss_of(fsdp::models::Transformer& m, int64_t step) {
  const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  at::Tensor toks = at::randint(0, 8, {kGlobalRows, 16}, gen).slice(0, r * kGlobalRows / W, (r + 1) * kGlobalRows / W);
  at::Tensor logits = fsdp::call(m, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
}

double global_mean(const at::Tensor& local) {
  at::Tensor t = local.detach().reshape({1}).clone();
  fsdp::world()->all_reduce(t, ReduceOp::kAvg)->wait();
  return t.item<double>();
}

// Whether `t` is bitwise the same on every rank of `group` (collective).
bool same_on_every_rank(const at::Tensor& t, fsdp::ProcessGroup& group) {
  at::Tensor flat = t.detach().reshape({-1}).contiguous();
  at::Tensor all = at::empty({group.size() * flat.numel()}, flat.options());
  group.all_gather_into(all, flat)->wait();
  for (int q = 0; q < group.size(); ++q) {
    if (!at::equal(all.narrow(0, q * flat.numel(), flat.numel()), flat)) return false;
  }
  return true;
}

// Losses of `steps` Adam steps (the global mean of each), from the same weights and batches.
std::vector<double> train(const fsdp::FullyShardOptions& opts, int64_t steps,
                          const std::shared_ptr<fsdp::ProcessGroup>& counted = nullptr,
                          fsdp::CollectiveStats* stats = nullptr) {
  auto model = make_transformer();
  shard(model, opts);
  torch::optim::Adam opt(model->parameters(), 1e-2);
  if (counted) counted->reset_stats();
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    opt.zero_grad();
    at::Tensor loss = loss_of(model, step);
    loss.backward();
    losses.push_back(global_mean(loss));
    opt.step();
  }
  if (counted && stats) *stats = counted->stats();
  return losses;
}

template <typename F>
void expect_error_containing(F&& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << text << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(text), std::string::npos) << e.what_without_backtrace();
  }
}

}  // namespace

// ------------------------------------------------------------------------------ weights

// Every rank computes with the same weights (each decodes the same bytes, its own row included),
// each within half a block scale of the fp32 weight, and the all-gathers move about 1 + 4 / B
// bytes per element instead of 4.
TEST(QuantizedWeights, EveryRankComputesWithTheSameDecodedWeights) {
  run_distributed(2, [] {
    const auto quantized = QuantizedComm().block_size(16);
    auto model = make_transformer(), exact = make_transformer();
    auto handles = shard(model, fsdp::FullyShardOptions().quantized_weights(quantized));
    handles.front().unshard();  // the first block: quantized all-gather
    auto group = handles.front().mesh().get_group(0);
    auto members = [](const fsdp::models::TransformerBlock& b) {
      return std::vector<at::Tensor>{
          b->attention->wq->weight,    b->attention->wk->weight,    b->attention->wv->weight,  b->attention->wo->weight,
          b->feed_forward->w1->weight, b->feed_forward->w2->weight, b->attention_norm->weight, b->ffn_norm->weight};
    };
    const std::vector<at::Tensor> unsharded = members(model->blocks().front());
    const std::vector<at::Tensor> fp32 = members(exact->blocks().front());
    // A block of the encoding may span parameters: bound every element by the group's largest weight.
    double largest = 0;
    for (const auto& p : exact->blocks().front()->parameters())
      largest = std::max(largest, p.abs().max().item<double>());
    for (size_t i = 0; i < fp32.size(); ++i) {
      SCOPED_TRACE("member " + std::to_string(i));
      ASSERT_EQ(unsharded[i].sizes(), fp32[i].sizes());
      EXPECT_LE((unsharded[i] - fp32[i]).abs().max().item<double>(), largest / 127 / 2 * (1 + 1e-5));
      EXPECT_TRUE(same_on_every_rank(unsharded[i], *group));
    }
    EXPECT_FALSE(at::equal(unsharded[0], fp32[0]));  // it was quantized
    handles.front().reshard();
    // The shards themselves stay exact.
    for (const auto& item : fsdp::full_state_dict(*model)) {
      const at::Tensor* w = exact->named_parameters().find(item.key());
      if (w) {
        EXPECT_TRUE(at::equal(item.value(), *w)) << item.key();
      }
    }
  });
}

TEST(QuantizedWeights, TrainsCloseToFp32OnAQuarterOfTheAllGatherBytes) {
  run_distributed(2, [] {
    constexpr int64_t kSteps = 12;
    auto group = fsdp::world();
    fsdp::CollectiveStats plain_stats, int8_stats, fp8_stats;
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    const auto base = fsdp::FullyShardOptions().mesh(mesh);
    const std::vector<double> fp32 = train(base, kSteps, mesh.get_group(0), &plain_stats);
    const std::vector<double> int8 =
        train(fsdp::FullyShardOptions(base).quantized_weights(QuantizedComm()), kSteps, mesh.get_group(0), &int8_stats);
    const std::vector<double> fp8 =
        train(fsdp::FullyShardOptions(base).quantized_weights(QuantizedComm().dtype(QuantizedDtype::kFloat8E4M3)),
              kSteps, mesh.get_group(0), &fp8_stats);
    // Blockwise int8 of the weights: about 0.4 % of a block's largest weight per element; the
    // losses of this small model stay within 2 % of fp32's over the run (measured: well under).
    for (int64_t s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(int8[s], fp32[s], 0.02 * fp32[s]) << "int8, step " << s;
      EXPECT_NEAR(fp8[s], fp32[s], 0.05 * fp32[s]) << "fp8, step " << s;
    }
    const int64_t plain = plain_stats[CollectiveKind::kAllGather].bytes_sent;
    const int64_t coded = int8_stats[CollectiveKind::kAllGather].bytes_sent;
    EXPECT_EQ(plain_stats[CollectiveKind::kAllGather].calls, int8_stats[CollectiveKind::kAllGather].calls);
    // 1 + 4 / 256 bytes per element and each row padded to 4 bytes, against 4.
    EXPECT_LT(coded * 3.5, plain) << coded << " against " << plain;
    EXPECT_EQ(plain_stats[CollectiveKind::kReduceScatter].bytes_sent,
              int8_stats[CollectiveKind::kReduceScatter].bytes_sent);
  });
}

// ------------------------------------------------------------------------------ gradients

namespace {

// The sharded gradients after one backward of `step` under `opts`, and the model's group.
std::vector<at::Tensor> grads_after_backward(const fsdp::FullyShardOptions& opts, int64_t step) {
  auto model = make_transformer();
  shard(model, opts);
  loss_of(model, step).backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

}  // namespace

// HSDP (2 replicas x 2 shards): every replica ends with bitwise the same gradient, within the
// codec's error of the exact mean, and the replicate group moves int8 (or bf16) instead of fp32.
TEST(QuantizedGradients, ReplicasGetTheSameGradientNearTheExactMean) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    const auto base = fsdp::FullyShardOptions().mesh(mesh);
    auto replicate = mesh.get_group(0);
    replicate->reset_stats();
    const std::vector<at::Tensor> exact = grads_after_backward(base, 0);
    const int64_t fp32_bytes = replicate->stats()[CollectiveKind::kAllReduce].bytes_sent;
    for (QuantizedDtype dtype : {QuantizedDtype::kInt8, QuantizedDtype::kBFloat16}) {
      SCOPED_TRACE(fsdp::to_string(dtype));
      replicate->reset_stats();
      const std::vector<at::Tensor> coded =
          grads_after_backward(fsdp::FullyShardOptions(base).quantized_gradients(QuantizedComm().dtype(dtype)), 0);
      const fsdp::CollectiveStats stats = replicate->stats();
      ASSERT_EQ(coded.size(), exact.size());
      // A block of the encoding may span parameters (it cuts the reduce-scatter output's row):
      // bound every element by the largest gradient of all, against which a replica's own is
      // at most twice as large here.
      double largest = 0;
      for (const auto& g : exact) largest = std::max(largest, g.abs().max().item<double>());
      for (size_t i = 0; i < exact.size(); ++i) {
        EXPECT_TRUE(same_on_every_rank(coded[i], *replicate)) << "parameter " << i;
        const double tol = dtype == QuantizedDtype::kInt8 ? largest * 2 / 127 : largest * 1e-2;
        EXPECT_LE((coded[i] - exact[i]).abs().max().item<double>(), tol + 1e-12) << "parameter " << i;
      }
      const int64_t sent = stats[CollectiveKind::kAllGather].bytes_sent + stats[CollectiveKind::kAllReduce].bytes_sent;
      if (dtype == QuantizedDtype::kInt8) {
        EXPECT_EQ(stats[CollectiveKind::kAllReduce].calls, 0);
        EXPECT_LT(sent * 3, fp32_bytes) << sent << " against " << fp32_bytes;
      } else {
        EXPECT_EQ(stats[CollectiveKind::kAllGather].calls, 0);
        EXPECT_EQ(sent * 2, fp32_bytes);
      }
    }
  });
}

// Error feedback: over K backward passes of the same batch (weights fixed), the sum of the
// gradients is K times the exact one, less one residual (within one scale); without it, every
// pass repeats the same rounding and the sum drifts K times as far.
TEST(QuantizedGradients, ErrorFeedbackKeepsTheSumOverStepsExact) {
  run_distributed(2, [] {
    constexpr int kPasses = 16;
    auto mesh = fsdp::init_device_mesh("cpu", {2, 1}, {"replicate", "shard"});
    const auto base = fsdp::FullyShardOptions().mesh(mesh);
    const std::vector<at::Tensor> exact = grads_after_backward(base, 3);
    auto drift = [&](bool feedback) {
      auto model = make_transformer();
      shard(model,
            fsdp::FullyShardOptions(base).quantized_gradients(QuantizedComm().block_size(32).error_feedback(feedback)));
      std::vector<at::Tensor> sum;
      for (int k = 0; k < kPasses; ++k) {
        for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
        loss_of(model, 3).backward();
        const auto params = model->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          if (k == 0) sum.push_back(params[i].grad().clone());
          else sum[i] += params[i].grad();
        }
      }
      double worst = 0;  // in units of each gradient's largest magnitude / 127
      for (size_t i = 0; i < exact.size(); ++i) {
        const double unit = exact[i].abs().max().item<double>() / 127;
        if (unit > 0) worst = std::max(worst, (sum[i] - exact[i] * kPasses).abs().max().item<double>() / unit);
      }
      return worst;
    };
    const double with = drift(true), without = drift(false);
    EXPECT_LE(with, 2.0);  // one residual of at most half a scale per replica, summed over 2
    EXPECT_GT(without, 2 * with) << "without error feedback the rounding should repeat";
  });
}

TEST(QuantizedGradients, TrainsCloseToFp32) {
  run_distributed(4, [] {
    constexpr int64_t kSteps = 12;
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    const auto base = fsdp::FullyShardOptions().mesh(mesh);
    const std::vector<double> fp32 = train(base, kSteps);
    const std::vector<double> int8 = train(fsdp::FullyShardOptions(base).quantized_gradients(QuantizedComm()), kSteps);
    const std::vector<double> both = train(
        fsdp::FullyShardOptions(base).quantized_gradients(QuantizedComm()).quantized_weights(QuantizedComm()), kSteps);
    for (int64_t s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(int8[s], fp32[s], 0.02 * fp32[s]) << "step " << s;
      EXPECT_NEAR(both[s], fp32[s], 0.03 * fp32[s]) << "step " << s;
    }
  });
}

namespace {

constexpr int64_t kVocab = 256, kDim = 32, kTokensPerRank = 8;

// This rank's tokens of pass k: a few rows of the embedding, other rows every pass.
at::Tensor tokens_of(int64_t pass) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + 2 * pass + fsdp::get_rank());
  return at::randint(0, kVocab, {kTokensPerRank}, gen);
}

struct EmbeddingPasses {
  std::vector<at::Tensor> grads;  // after each backward pass
  std::vector<int64_t> sent;      // the replicate group's all-gather bytes of each pass
};

// An embedding of its own on a (replicate 2, shard 1) mesh, `passes` backward passes, weights fixed.
EmbeddingPasses embedding_passes(const fsdp::DeviceMesh& mesh, const QuantizedComm& format, int64_t passes) {
  torch::manual_seed(0);
  torch::nn::Embedding emb(kVocab, kDim);
  fsdp::fully_shard(emb, fsdp::FullyShardOptions().mesh(mesh).quantized_gradients(format));
  auto replicate = mesh.get_group(0);
  EmbeddingPasses out;
  for (int64_t k = 0; k < passes; ++k) {
    at::Tensor param = emb->parameters()[0];
    param.mutable_grad() = at::Tensor();
    replicate->reset_stats();
    fsdp::call(emb, tokens_of(k)).pow(2).sum().backward();
    out.sent.push_back(replicate->stats()[CollectiveKind::kAllGather].bytes_sent);
    out.grads.push_back(param.grad().clone());
  }
  return out;
}

}  // namespace

// skip_zero_blocks: the first pass is dense and counts the blocks; after it each replica sends
// only the rows its tokens touched (blocks of one row here). Every replica gets bitwise the same
// gradient; a row no replica touched is exactly zero; and over passes whose tokens change, the sum
// of the gradients stays within one residual of the exact sum: a skipped block's residual waits
// for a later pass, nothing is lost. A block index off by one (the planted error) would put rows
// in the wrong place and break the row check.
TEST(QuantizedGradients, SkipZeroBlocksSendsOnlyTheTouchedRowsAndLosesNothing) {
  run_distributed(2, [] {
    constexpr int64_t kPasses = 6;
    auto mesh = fsdp::init_device_mesh("cpu", {2, 1}, {"replicate", "shard"});
    auto replicate = mesh.get_group(0);
    const QuantizedComm format = QuantizedComm().block_size(kDim);
    const EmbeddingPasses dense = embedding_passes(mesh, format, kPasses);
    const EmbeddingPasses sparse = embedding_passes(mesh, QuantizedComm(format).skip_zero_blocks(true), kPasses);
    // The first pass is the dense codec's plus a 4-byte count; the later ones a fraction of it.
    EXPECT_EQ(sparse.sent[0], dense.sent[0] + 4);
    at::Tensor exact_sum = at::zeros({kVocab, kDim});
    at::Tensor sparse_sum = at::zeros({kVocab, kDim});
    for (int64_t k = 0; k < kPasses; ++k) {
      SCOPED_TRACE("pass " + std::to_string(k));
      if (k > 0) {
        EXPECT_LT(sparse.sent[k] * 8, dense.sent[k]) << sparse.sent[k] << " against " << dense.sent[k];
      }
      EXPECT_TRUE(same_on_every_rank(sparse.grads[k], *replicate));
      // The exact mean over both replicas: each row's gradient is 2 x weight x (its count).
      at::Tensor mine = tokens_of(k), all = at::empty({2 * kTokensPerRank}, mine.options());
      replicate->all_gather_into(all, mine)->wait();
      at::Tensor touched = at::zeros({kVocab}, at::kBool).index_fill_(0, all, true);
      EXPECT_TRUE(sparse.grads[k].index({touched.logical_not()}).eq(0).all().item<bool>())
          << "a row no replica touched got a gradient";
      EXPECT_TRUE(sparse.grads[k].index({touched}).ne(0).any(1).all().item<bool>()) << "a touched row got none";
      exact_sum += dense.grads[k];  // within the codec's error of exact; compared as sums below
      sparse_sum += sparse.grads[k];
    }
    // Both codecs carry their residuals: their sums over the passes agree within a few scales.
    const double unit = exact_sum.abs().max().item<double>() / 127;
    EXPECT_LE((sparse_sum - exact_sum).abs().max().item<double>(), 4 * unit);
  });
}

namespace {

constexpr int64_t kWideVocab = 512;

struct HsdpRun {
  std::vector<double> losses;
  int64_t sent_after_first_step = 0;  // the replicate group's all-gather bytes of steps 1..
  bool replicas_agree = true;         // every parameter's shard bitwise the same on both replicas
  // The last step: the embedding's rows that no rank's tokens touched have exactly zero gradient,
  // and every touched row has some (this rank's shard of the rows).
  bool untouched_rows_zero = false, touched_rows_nonzero = false;
};

// This rank's shard of a (replicate 2, shard 2) mesh's dim-0 sharded `grad` of kWideVocab rows
// against the rows the step's tokens (every rank's) touched.
void check_embedding_rows(const at::Tensor& grad, const at::Tensor& tokens, HsdpRun& run) {
  at::Tensor all = at::empty({fsdp::get_world_size() * tokens.numel()}, tokens.options());
  fsdp::world()->all_gather_into(all, tokens.reshape({-1}).contiguous())->wait();
  const int64_t rows = grad.size(0), first = (fsdp::get_rank() % 2) * rows;
  at::Tensor touched = at::zeros({kWideVocab}, at::kBool).index_fill_(0, all, true).narrow(0, first, rows);
  run.untouched_rows_zero = grad.index({touched.logical_not()}).eq(0).all().item<bool>();
  run.touched_rows_nonzero = grad.index({touched}).ne(0).any(1).all().item<bool>();
}

// A Transformer whose embedding has far more rows than a step's tokens touch, trained `steps` Adam
// steps on a (replicate 2, shard 2) mesh: every reduce-scatter runs over two ranks, so each
// quantized all-reduce waits for the next post-backward or the end of backward to be issued.
HsdpRun train_wide_vocab_hsdp(const QuantizedComm& format, int64_t steps) {
  auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  auto replicate = mesh.get_group(0);
  torch::manual_seed(0);
  fsdp::models::ModelArgs args;
  args.vocab_size = kWideVocab;
  args.dropout_p = 0.0;
  // The final norm and the head a group of their own (fsdp-train's output_head_group), so that the
  // root group is the embeddings: most of its blocks are zero in every step.
  const auto opts = fsdp::FullyShardOptions().mesh(mesh).quantized_gradients(format);
  fsdp::models::Transformer model = fsdp::models::sharded_transformer(args, opts, opts, opts);
  torch::optim::Adam opt(model->parameters(), 1e-2);
  HsdpRun run;
  for (int64_t step = 0; step < steps; ++step) {
    if (step == 1) replicate->reset_stats();
    opt.zero_grad();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1100 + 4 * step + fsdp::get_rank());
    at::Tensor toks = at::randint(0, kWideVocab, {2, 16}, gen);
    at::Tensor logits = fsdp::call(model, toks);
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, kWideVocab}), toks.roll(-1, 1).reshape({-1}));
    loss.backward();
    run.losses.push_back(global_mean(loss));
    if (step == steps - 1) check_embedding_rows(model->named_parameters()["tok_embeddings.weight"].grad(), toks, run);
    opt.step();
  }
  run.sent_after_first_step = replicate->stats()[CollectiveKind::kAllGather].bytes_sent;
  for (const auto& p : model->parameters())
    run.replicas_agree = run.replicas_agree && same_on_every_rank(p, *replicate);
  return run;
}

}  // namespace

// skip_zero_blocks where each replica is sharded over two ranks (HSDP 2 x 2): the all-reduces are
// issued in the deferred order, every rank the same, and the sparse rows still reach the right
// places: the replicas stay bitwise equal, the losses follow the dense codec's, the embedding's
// untouched rows are not sent, and its gradient is nonzero exactly on the rows the step touched.
TEST(QuantizedGradients, SkipZeroBlocksOnShardedReplicasFollowsTheDenseCodec) {
  run_distributed(4, [] {
    constexpr int64_t kSteps = 4;
    const QuantizedComm format = QuantizedComm().block_size(16);
    const HsdpRun dense = train_wide_vocab_hsdp(format, kSteps);
    const HsdpRun sparse = train_wide_vocab_hsdp(QuantizedComm(format).skip_zero_blocks(true), kSteps);
    EXPECT_TRUE(dense.replicas_agree);
    EXPECT_TRUE(sparse.replicas_agree) << "the replicas' shards differ after the sparse all-reduces";
    EXPECT_TRUE(sparse.untouched_rows_zero) << "a row no rank touched got a gradient";
    EXPECT_TRUE(sparse.touched_rows_nonzero) << "a touched row got none";
    // The embeddings' group sends a fraction of its blocks; the blocks' and the head's groups stay
    // dense (about 0.7 of the dense bytes in all here).
    EXPECT_LT(sparse.sent_after_first_step * 4, dense.sent_after_first_step * 3)
        << sparse.sent_after_first_step << " bytes against the dense codec's " << dense.sent_after_first_step;
    for (int64_t s = 0; s < kSteps; ++s) EXPECT_NEAR(sparse.losses[s], dense.losses[s], 0.01 * dense.losses[s]);
  });
}

// ------------------------------------------------------------------------------ refusals

TEST(QuantizedComm, RefusalsNameTheOptionAndTheRemedy) {
  run_distributed(2, [] {
    {
      auto model = make_transformer();
      expect_error_containing(
          [&] { fsdp::fully_shard(model, fsdp::FullyShardOptions().quantized_gradients(QuantizedComm())); },
          "quantized_gradients quantizes HSDP's all-reduce over the replicate mesh dim");
    }
    {
      auto model = make_transformer();
      expect_error_containing(
          [&] { fsdp::fully_shard(model, fsdp::FullyShardOptions().quantized_weights(QuantizedComm().block_size(8))); },
          "quantized_weights: QuantizedComm::block_size must be 16 to 4096, got 8");
    }
    {
      auto model = make_transformer();
      auto handles = shard(model, fsdp::FullyShardOptions().quantized_weights(QuantizedComm()));
      struct Plain : fsdp::AllGather {
        fsdp::WorkHandle operator()(const at::Tensor& out, const at::Tensor& in, fsdp::ProcessGroup& g) override {
          return g.all_gather_into(out, in);
        }
      };
      handles.back().set_custom_all_gather(std::make_shared<Plain>());
      expect_error_containing([&] { handles.back().unshard(); }, "has both quantized_weights and a custom all-gather");
    }
    {
      auto mesh = fsdp::init_device_mesh("cpu", {2, 1}, {"replicate", "shard"});
      auto model = make_transformer();
      const QuantizedComm bf16 = QuantizedComm().dtype(QuantizedDtype::kBFloat16).skip_zero_blocks(true);
      expect_error_containing(
          [&] { fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh).quantized_gradients(bf16)); },
          "skip_zero_blocks needs blocks with scales (int8 or float8_e4m3), but the dtype is bfloat16");
      expect_error_containing(
          [&] {
            fsdp::fully_shard(model,
                              fsdp::FullyShardOptions().quantized_weights(QuantizedComm().skip_zero_blocks(true)));
          },
          "only gradients skip zero blocks");
    }
  });
}
