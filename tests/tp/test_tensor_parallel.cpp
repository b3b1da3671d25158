// Tensor parallelism (fsdp/tensor_parallel.h) across real processes: the column- and
// row-parallel Linear layers against a whole Linear, the vocab-parallel cross-entropy against
// cross_entropy, parallelize on the reference Transformer (with and without the vocab-parallel
// embedding and head) trained at tp 2 and 4 against one process on the same batch (losses and
// full parameters), its collectives, its layouts, its state dicts and checkpoints (with and
// without fully_shard), and its errors.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor_parameter.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/linear_cross_entropy.h>
#include <fsdp/models/parallelize.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <filesystem>
#include <functional>
#include <string>

using fsdp::testing::run_distributed;
namespace tp = fsdp::tp;
namespace models = fsdp::models;

namespace {

fsdp::models::ModelArgs tp_args(int64_t dim, int64_t n_heads, int64_t vocab_size = 7) {
  fsdp::models::ModelArgs args;
  args.n_layers = 2;
  args.vocab_size = vocab_size;
  args.max_seq_len = 8;
  args.dim = dim;
  args.n_heads = n_heads;
  args.dropout_p = 0.0;
  return args;
}

// The whole tensor a (possibly split) parameter is a piece of. Collective over its mesh.
at::Tensor full_of(const at::Tensor& p) {
  if (fsdp::is_sharded_parameter(p)) return fsdp::as_dtensor(p).full_tensor();
  if (auto d = fsdp::dtensor_parameter(p)) return d->full_tensor();
  return p;
}

at::Tensor step_tokens(int64_t step, int64_t rows, int64_t seq, int64_t vocab) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return at::randint(vocab, {rows, seq + 1}, gen, at::TensorOptions().dtype(at::kLong));
}

at::Tensor lm_loss(fsdp::models::Transformer& model, const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1) - 1;
  at::Tensor logits = fsdp::call(model, tokens.narrow(1, 0, seq));
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                              tokens.narrow(1, 1, seq).reshape({-1}));
}

using LossFn = std::function<at::Tensor(fsdp::models::Transformer&, const at::Tensor&)>;

// The trainer's loss: TransformerImpl::forward_loss in `chunks` pieces (a vocab-parallel head's
// logits are then never gathered).
LossFn forward_loss(int64_t chunks) {
  return [chunks](fsdp::models::Transformer& model, const at::Tensor& tokens) {
    const int64_t seq = tokens.size(1) - 1;
    return fsdp::call_method(model, &fsdp::models::TransformerImpl::forward_loss, tokens.narrow(1, 0, seq),
                             tokens.narrow(1, 1, seq).contiguous(), chunks);
  };
}

// How `model` is split: tensor parallelism over `mesh` (and FSDP over its dp dim when `fsdp`).
struct Layout {
  fsdp::DeviceMesh mesh;
  std::string tp_dim;  // "" for a 1-D mesh
  bool fsdp = false;
};

// Trains `model` (already parallelized / sharded per `layout`) and a whole copy on the same
// global batches; every dp rank takes its rows, every tp rank of a dp rank the same ones.
// With `max_norm` > 0 both sides clip with fsdp::clip_grad_norm_, and their norms must agree.
void expect_parity(fsdp::models::Transformer& reference, fsdp::models::Transformer& model, const Layout& layout,
                   const std::string& what, double max_norm = 0.0, const LossFn& loss_of = lm_loss, int steps = 3,
                   int64_t rows_per_dp = 2) {
  const fsdp::models::ModelArgs& args = reference->args();
  const int64_t dp = layout.tp_dim.empty() ? 1 : layout.mesh.size(0);
  const int64_t dp_rank = layout.tp_dim.empty() ? 0 : layout.mesh.get_local_rank(0);
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    const at::Tensor global = step_tokens(step, rows_per_dp * dp, args.max_seq_len, args.vocab_size);
    ref_opt.zero_grad();
    at::Tensor ref_loss = loss_of(reference, global);
    ref_loss.backward();
    const double ref_norm = max_norm > 0 ? fsdp::clip_grad_norm_(reference->parameters(), max_norm) : 0.0;
    ref_opt.step();

    opt.zero_grad();
    at::Tensor loss = loss_of(model, global.narrow(0, dp_rank * rows_per_dp, rows_per_dp));
    loss.backward();
    if (max_norm > 0) {
      EXPECT_NEAR(fsdp::clip_grad_norm_(model->parameters(), max_norm), ref_norm, 1e-5) << what << " step " << step;
    }
    opt.step();
    // The mean over the dp ranks (tp ranks hold equal losses) is the global batch's mean.
    at::Tensor mean = loss.detach().clone().reshape({1});
    fsdp::world()->all_reduce(mean, fsdp::ReduceOp::kAvg)->wait();
    EXPECT_NEAR(mean.item<double>(), ref_loss.item<double>(), 1e-5) << what << " step " << step;
  }
  auto ref_params = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    ASSERT_TRUE(ref_params.contains(item.key())) << item.key();
    const at::Tensor full = full_of(item.value());
    const at::Tensor& expect = ref_params[item.key()];
    ASSERT_EQ(full.sizes(), expect.sizes()) << what << ": " << item.key();
    EXPECT_LT((full - expect).abs().max().item<double>(), 1e-5) << what << ": " << item.key();
  }
}

fsdp::models::Transformer seeded_model(const fsdp::models::ModelArgs& args) {
  torch::manual_seed(7);
  return fsdp::models::Transformer(args);
}

}  // namespace

// The two layers on their own: column then row parallel equals the whole two-layer MLP, in
// forward and in the gradients of the input and of every weight piece.
TEST(TensorParallel, ColumnThenRowEqualsWholeLayers) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      auto mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
      torch::manual_seed(3);
      torch::nn::Linear fc1(6, 8), fc2(8, 5);
      tp::TensorParallelMesh tpm(mesh);
      tp::ColumnParallelLinear col(*fc1, tpm);
      tp::RowParallelLinear row(*fc2, tpm);
      const at::Tensor x = at::randn({3, 6}, at::make_generator<at::CPUGeneratorImpl>(9)).requires_grad_();
      const at::Tensor x2 = x.detach().clone().requires_grad_();
      at::Tensor ref = fc2(at::gelu(fc1(x)));
      at::Tensor out = fsdp::call(row, at::gelu(fsdp::call(col, x2)));
      EXPECT_LT((out - ref).abs().max().item<double>(), 1e-6);
      ref.pow(2).sum().backward();
      out.pow(2).sum().backward();
      EXPECT_LT((x2.grad() - x.grad()).abs().max().item<double>(), 1e-6);
      const std::vector<std::pair<at::Tensor, at::Tensor>> pairs = {
          {col->weight, fc1->weight}, {col->bias, fc1->bias}, {row->weight, fc2->weight}, {row->bias, fc2->bias}};
      for (const auto& [piece, whole] : pairs) {
        auto d = fsdp::dtensor_parameter(piece);
        ASSERT_TRUE(d.has_value());
        EXPECT_EQ(d->sizes(), whole.sizes().vec());
        EXPECT_LT((d->full_tensor() - whole).abs().max().item<double>(), 0.0 + 1e-7);
        // Gradients are pieces of the whole gradients, with the same layout.
        auto g = fsdp::DTensor::from_local(piece.grad(), d->device_mesh(), d->placements(), d->sizes());
        EXPECT_LT((g.full_tensor() - whole.grad()).abs().max().item<double>(), 1e-6);
      }
      EXPECT_EQ(fsdp::dtensor_parameter(col->weight)->placements()[0], fsdp::Shard(0));
      EXPECT_EQ(fsdp::dtensor_parameter(row->weight)->placements()[0], fsdp::Shard(1));
      EXPECT_EQ(fsdp::dtensor_parameter(row->bias)->placements()[0], fsdp::Replicate());
    });
  }
}

// The Transformer at tp 2 and tp 4 (1 head per rank) trains like one process on the same batch.
TEST(TensorParallel, TransformerParityWithOneProcess) {
  for (int world : {2, 4}) {
    run_distributed(world, [world] {
      auto mesh = fsdp::init_device_mesh("cpu", {world});
      const auto args = tp_args(12, 4);
      auto reference = seeded_model(args);
      auto model = seeded_model(args);
      models::parallelize(model, tp::TensorParallelMesh(mesh));
      // The split layers hold their pieces; the rest is whole.
      auto& attention = *model->blocks()[0]->attention;
      EXPECT_EQ(attention.wq->weight.sizes(), (std::vector<int64_t>{12 / world, 12}));
      EXPECT_EQ(attention.wo->weight.sizes(), (std::vector<int64_t>{12, 12 / world}));
      EXPECT_EQ(model->blocks()[0]->feed_forward->w1->bias.sizes(), (std::vector<int64_t>{48 / world}));
      EXPECT_EQ(model->output->weight.sizes(), (std::vector<int64_t>{7, 12}));
      EXPECT_EQ(fsdp::dtensor_parameter(model->output->weight)->placements()[0], fsdp::Replicate());
      expect_parity(reference, model, Layout{mesh, ""}, "tp" + std::to_string(world), /*max_norm=*/0.5);
    });
  }
}

// Each tp rank's forward does one all-reduce per row-parallel layer (wo, w2); backward one per
// column-parallel input (the attention's x, shared by wq, wk and wv, and w1's input): 4 per
// block, Megatron's count. The vocab-parallel embedding adds one in forward, the parallel
// cross-entropy two of a few bytes a row, the vocab-parallel head's input gradient one in backward;
// nothing is all-gathered.
TEST(TensorParallel, AllReducesPerBlock) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto group = mesh.get_group(0);
    for (bool vocab_parallel : {false, true}) {
      SCOPED_TRACE(vocab_parallel ? "vocab-parallel" : "whole head");
      auto model = seeded_model(tp_args(12, 4, 8));
      models::parallelize(model, tp::TensorParallelMesh(mesh),
                          models::ParallelizeOptions().vocab_parallel(vocab_parallel));
      const int64_t blocks = model->args().n_layers;
      group->reset_stats();
      at::Tensor loss = forward_loss(1)(model, step_tokens(0, 2, 8, 8));
      EXPECT_EQ(group->stats()[fsdp::CollectiveKind::kAllReduce].calls, 2 * blocks + (vocab_parallel ? 3 : 0));
      loss.backward();
      EXPECT_EQ(group->stats()[fsdp::CollectiveKind::kAllReduce].calls, 4 * blocks + (vocab_parallel ? 4 : 0));
      EXPECT_EQ(group->stats().total_calls(), 4 * blocks + (vocab_parallel ? 4 : 0));
    }
  });
}

TEST(TensorParallel, HeadsNotDivisibleByTpAreRejected) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {4});
    auto model = seeded_model(tp_args(6, 2));
    try {
      models::parallelize(model, tp::TensorParallelMesh(mesh));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("n_heads=2 is not divisible by the tensor-parallel size 4"),
                std::string::npos)
          << e.what();
    }
  });
  EXPECT_THROW(models::check_parallelizable(12, 12, 5), c10::Error);
  EXPECT_NO_THROW(models::check_parallelizable(12, 12, 3));
}

TEST(TensorParallel, VocabNotDivisibleByTpIsRejected) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto model = seeded_model(tp_args(12, 4, 7));
    try {
      models::parallelize(model, tp::TensorParallelMesh(mesh), models::ParallelizeOptions().vocab_parallel(true));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("vocab_size=7 is not divisible by the tensor-parallel size 2"),
                std::string::npos)
          << e.what();
    }
    // Refused before anything was split: the model can still be parallelized with a whole head.
    EXPECT_NO_THROW(models::parallelize(model, tp::TensorParallelMesh(mesh)));
  });
  EXPECT_THROW(models::check_vocab_parallelizable(10, 4), c10::Error);
  EXPECT_NO_THROW(models::check_vocab_parallelizable(12, 4));
}

// ------------------------------------------------------------------ the vocab-parallel loss

// The parallel cross-entropy against at::cross_entropy on the whole logits (an ignored row, and
// rows of large logits whose exp overflows fp32), in value and in gradient; and the chunked head
// and loss on a vocab-parallel head against the whole head's.
TEST(TensorParallel, VocabParallelCrossEntropyMatchesCrossEntropy) {
  for (int world : {2, 4}) {
    run_distributed(world, [world] {
      auto mesh = fsdp::init_device_mesh("cpu", {world});
      auto group = mesh.get_group(0);
      const int64_t rows = 10, vocab = 12, dim = 5, n = vocab / world, rank = fsdp::get_rank();
      const tp::VocabSlice slice{rank * n, n, group};
      auto gen = at::make_generator<at::CPUGeneratorImpl>(21);
      at::Tensor logits = at::randn({rows, vocab}, gen) * 3;
      logits[7] += 1e3;  // exp(1e3) overflows: only the log-sum-exp form survives
      at::Tensor targets = at::randint(vocab, {rows}, gen, at::TensorOptions().dtype(at::kLong));
      targets[3] = -100;
      const at::Tensor whole = logits.clone().requires_grad_();
      const at::Tensor ref = torch::nn::functional::cross_entropy(whole, targets);
      const at::Tensor local = logits.narrow(1, rank * n, n).clone().requires_grad_();
      const at::Tensor loss = tp::vocab_parallel_cross_entropy(local, targets, slice);
      EXPECT_NEAR(loss.item<double>(), ref.item<double>(), 1e-5);
      ref.backward();
      loss.backward();
      EXPECT_LT((local.grad() - whole.grad().narrow(1, rank * n, n)).abs().max().item<double>(), 1e-6);

      // Head and loss in one node, 3 pieces: x's gradient summed over tp by copy_to_tp_region.
      const at::Tensor x = at::randn({rows, dim}, gen).requires_grad_();
      const at::Tensor weight = at::randn({vocab, dim}, gen).requires_grad_();
      const at::Tensor ref_sum = fsdp::models::chunked_linear_cross_entropy(x, weight, targets, 3);
      const at::Tensor x2 = x.detach().clone().requires_grad_();
      const at::Tensor w2 = weight.detach().narrow(0, rank * n, n).clone().requires_grad_();
      const at::Tensor sum =
          fsdp::models::chunked_linear_cross_entropy(tp::copy_to_tp_region(x2, group), w2, targets, 3, slice);
      EXPECT_NEAR(sum.item<double>(), ref_sum.item<double>(), 1e-4);
      ref_sum.backward();
      sum.backward();
      EXPECT_LT((x2.grad() - x.grad()).abs().max().item<double>(), 1e-5);
      EXPECT_LT((w2.grad() - weight.grad().narrow(0, rank * n, n)).abs().max().item<double>(), 1e-5);

      at::Tensor bad = targets.clone();
      bad[0] = vocab;
      EXPECT_THROW(tp::vocab_parallel_cross_entropy(local, bad, slice), c10::Error);
    });
  }
}

// The Transformer with a vocab-parallel embedding and head at tp 2 and tp 4 trains like one
// process through forward_loss (whole and in 3 pieces), and forward still returns the whole
// logits on every tp rank.
TEST(TensorParallel, VocabParallelTransformerParityWithOneProcess) {
  for (int world : {2, 4}) {
    run_distributed(world, [world] {
      auto mesh = fsdp::init_device_mesh("cpu", {world});
      const auto args = tp_args(12, 4, 8);
      for (int64_t chunks : {1, 3}) {
        const std::string what = "tp" + std::to_string(world) + " chunks " + std::to_string(chunks);
        auto reference = seeded_model(args);
        auto model = seeded_model(args);
        models::parallelize(model, tp::TensorParallelMesh(mesh), models::ParallelizeOptions().vocab_parallel(true));
        EXPECT_EQ(model->tok_embeddings->weight.sizes(), (std::vector<int64_t>{8 / world, 12}));
        EXPECT_EQ(model->output->weight.sizes(), (std::vector<int64_t>{8 / world, 12}));
        EXPECT_EQ(fsdp::dtensor_parameter(model->output->weight)->placements()[0], fsdp::Shard(0));
        EXPECT_EQ(fsdp::dtensor_parameter(model->tok_embeddings->weight)->placements()[0], fsdp::Shard(0));
        EXPECT_EQ(fsdp::dtensor_parameter(model->pos_embeddings->weight)->placements()[0], fsdp::Replicate());
        expect_parity(reference, model, Layout{mesh, ""}, what, /*max_norm=*/0.5, forward_loss(chunks));
        const at::Tensor tokens = step_tokens(9, 2, 8, 8).narrow(1, 0, 8);
        at::NoGradGuard no_grad;
        EXPECT_LT((fsdp::call(model, tokens) - fsdp::call(reference, tokens)).abs().max().item<double>(), 1e-5) << what;
      }
    });
  }
}

// ------------------------------------------------------------------ FSDP over tensor parallelism

namespace {

fsdp::FullyShardOptions dp_tp_options(const fsdp::DeviceMesh& mesh) {
  return fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(fsdp::DataParallelMeshDims().shard("dp"));
}

// The model split over tp, then each block and the root sharded over dp.
void parallelize_and_shard(fsdp::models::Transformer& model, const fsdp::DeviceMesh& mesh,
                           bool vocab_parallel = false) {
  models::parallelize(model, tp::TensorParallelMesh(mesh, "tp"),
                      models::ParallelizeOptions().vocab_parallel(vocab_parallel));
  for (auto& block : model->blocks()) fsdp::fully_shard(block, dp_tp_options(mesh));
  fsdp::fully_shard(model, dp_tp_options(mesh));
}

}  // namespace

// dp 2 x tp 2 at W=4, with dim 6 and 2 heads, so that each tp rank's wq (3 rows), the
// embeddings and the head (vocab 7) split unevenly over dp; gradients clipped.
TEST(TensorParallel, FsdpOverTpParityWithOneProcess) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const auto args = tp_args(6, 2);
    auto reference = seeded_model(args);
    auto model = seeded_model(args);
    parallelize_and_shard(model, mesh);
    // The layouts on the whole mesh: FSDP's dp split composed with TP's.
    auto& attention = *model->blocks()[0]->attention;
    const fsdp::DTensor wq = fsdp::as_dtensor(attention.wq->weight);
    EXPECT_EQ(wq.placements(), (std::vector<fsdp::Placement>{fsdp::StridedShard(0, 2), fsdp::Shard(0)}));
    EXPECT_EQ(wq.sizes(), (std::vector<int64_t>{6, 6}));
    EXPECT_EQ(wq.to_local().size(0), mesh.get_local_rank(0) == 0 ? 2 : 1);  // 3 tp rows over 2 dp ranks
    EXPECT_EQ(fsdp::as_dtensor(attention.wo->weight).placements(),
              (std::vector<fsdp::Placement>{fsdp::Shard(0), fsdp::Shard(1)}));
    EXPECT_EQ(fsdp::as_dtensor(model->output->weight).placements(),
              (std::vector<fsdp::Placement>{fsdp::Shard(0), fsdp::Replicate()}));
    EXPECT_EQ(fsdp::as_dtensor(attention.wq->weight).placements()[0].str(), "_StridedShard(dim=0, sf=2)");
    expect_parity(reference, model, Layout{mesh, "tp", true}, "dp2 x tp2", /*max_norm=*/0.5);
  });
}

// dp 2 x tp 2 with the vocab-parallel embedding and head: vocab 10, so each tp rank's 5 rows of
// each split over dp 3 + 2; the loss through forward_loss, whole and in 3 pieces.
TEST(TensorParallel, FsdpOverVocabParallelParityWithOneProcess) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    const auto args = tp_args(6, 2, 10);
    for (int64_t chunks : {1, 3}) {
      auto reference = seeded_model(args);
      auto model = seeded_model(args);
      parallelize_and_shard(model, mesh, /*vocab_parallel=*/true);
      for (const at::Tensor& weight : {model->tok_embeddings->weight, model->output->weight}) {
        const fsdp::DTensor d = fsdp::as_dtensor(weight);
        EXPECT_EQ(d.placements(), (std::vector<fsdp::Placement>{fsdp::StridedShard(0, 2), fsdp::Shard(0)}));
        EXPECT_EQ(d.sizes(), (std::vector<int64_t>{10, 6}));
        EXPECT_EQ(d.to_local().size(0), mesh.get_local_rank(0) == 0 ? 3 : 2);  // 5 tp rows over 2 dp ranks
      }
      expect_parity(reference, model, Layout{mesh, "tp", true},
                    "dp2 x tp2 vocab-parallel, chunks " + std::to_string(chunks),
                    /*max_norm=*/0.5, forward_loss(chunks));
    }
  });
}

// The dp group carries FSDP's all-gathers and reduce-scatters only, the tp group the blocks'
// all-reduces only: 2 per block in forward (wo, w2), 2 in backward (the attention's input, w1's
// input), and with the vocab-parallel embedding and head 4 more (the embedding, the loss's 2,
// the head's input gradient).
TEST(TensorParallel, FsdpOverTpCollectivesStayOnTheirGroups) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    for (bool vocab_parallel : {false, true}) {
      SCOPED_TRACE(vocab_parallel ? "vocab-parallel" : "whole head");
      auto model = seeded_model(tp_args(6, 2, 8));
      parallelize_and_shard(model, mesh, vocab_parallel);
      auto dp = mesh.get_group("dp"), tpg = mesh.get_group("tp");
      const int64_t blocks = model->args().n_layers, groups = blocks + 1;
      const int64_t tp_all_reduces = 4 * blocks + (vocab_parallel ? 4 : 0);
      for (int iteration = 0; iteration < 2; ++iteration) {
        dp->reset_stats();
        tpg->reset_stats();
        forward_loss(1)(model, step_tokens(iteration, 2, 8, 8)).backward();
        const fsdp::CollectiveStats d = dp->stats(), t = tpg->stats();
        // Forward gathers every group; backward gathers the blocks again (the root keeps its
        // parameters from forward to backward); backward reduce-scatters every group.
        EXPECT_EQ(d[fsdp::CollectiveKind::kAllGather].calls, groups + blocks);
        EXPECT_EQ(d[fsdp::CollectiveKind::kReduceScatter].calls, groups);
        EXPECT_EQ(d[fsdp::CollectiveKind::kAllReduce].calls, 0);
        EXPECT_EQ(d.total_calls(), groups + blocks + groups);
        EXPECT_EQ(t[fsdp::CollectiveKind::kAllReduce].calls, tp_all_reduces);
        EXPECT_EQ(t.total_calls(), tp_all_reduces);
      }
    }
  });
}

TEST(TensorParallel, DpMeshDimsErrors) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto expect_error = [](const std::function<void()>& f, const std::string& part) {
      try {
        f();
        ADD_FAILURE() << "expected an error containing: " << part;
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      }
    };
    // A plain (unregistered) parameter.
    expect_error([&] { fsdp::fully_shard(torch::nn::Linear(4, 4).ptr(), dp_tp_options(mesh)); },
                 "all parameters must be DTensors on the full SPMD mesh");
    expect_error(
        [&] {
          fsdp::fully_shard(torch::nn::Linear(4, 4).ptr(),
                            fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(fsdp::DataParallelMeshDims()));
        },
        "needs at least one of shard or replicate");
    expect_error(
        [&] {
          fsdp::fully_shard(torch::nn::Linear(4, 4).ptr(),
                            fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(
                                fsdp::DataParallelMeshDims().shard("dp").replicate("r")));
        },
        "not supported yet");
    expect_error(
        [&] { fsdp::fully_shard(torch::nn::Linear(4, 4).ptr(), dp_tp_options(mesh).reshard_after_forward(2)); },
        "an int reshard_after_forward (2) is not supported with dp_mesh_dims");
    // Sharded (not Replicate()) over dp already.
    torch::nn::Linear lin(4, 4);
    fsdp::register_dtensor_parameter(lin->weight, mesh, {fsdp::Shard(0), fsdp::Replicate()}, {8, 4});
    fsdp::register_dtensor_parameter(lin->bias, mesh, {fsdp::Replicate(), fsdp::Replicate()}, {4});
    expect_error([&] { fsdp::fully_shard(lin.ptr(), dp_tp_options(mesh)); },
                 "is Shard(0) on the data-parallel mesh dim 'dp'");
  });
}

// ------------------------------------------------------------------ state dicts and checkpoints

namespace {

// The model of the checkpoint tests: vocab 12, so that tp 2 and tp 4 split the vocabulary.
fsdp::models::ModelArgs checkpoint_args() { return tp_args(12, 4, 12); }

// How a checkpoint test lays the model out: dp x tp ranks (W = dp * tp), TP over a (dp, tp) mesh
// with FSDP over dp, the embedding and head split by vocabulary or whole; plain FSDP on a 1-D
// mesh for tp 1.
struct CheckpointLayout {
  int64_t dp;
  int64_t tp;
  bool vocab_parallel = false;
  int world() const { return static_cast<int>(dp * tp); }
  std::string name() const {
    return "dp" + std::to_string(dp) + "tp" + std::to_string(tp) + (vocab_parallel ? "vocab" : "");
  }
};

fsdp::models::Transformer build_layout(const CheckpointLayout& layout) {
  auto model = seeded_model(checkpoint_args());
  if (layout.tp == 1) {
    auto mesh = fsdp::init_device_mesh("cpu", {layout.dp});
    for (auto& block : model->blocks()) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh));
    fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
  } else {
    parallelize_and_shard(model, fsdp::init_device_mesh("cpu", {layout.dp, layout.tp}, {"dp", "tp"}),
                          layout.vocab_parallel);
  }
  return model;
}

// Values different from the seeded model's, the same on every rank.
fsdp::TensorStateDict other_values() {
  torch::manual_seed(11);
  fsdp::models::Transformer m(checkpoint_args());
  fsdp::TensorStateDict out;
  for (const auto& item : m->named_parameters()) out.insert(item.key(), item.value().detach().clone());
  return out;
}

void expect_values(const fsdp::TensorStateDict& got, const fsdp::TensorStateDict& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& item : want) {
    const at::Tensor* g = got.find(item.key());
    ASSERT_NE(g, nullptr) << what << ": " << item.key();
    ASSERT_EQ(g->sizes(), item.value().sizes()) << what << ": " << item.key();
    EXPECT_TRUE(at::equal(*g, item.value())) << what << ": " << item.key();
  }
}

}  // namespace

// The state dicts of dp2 x tp2 (vocab-parallel) show both placements, and the full state dict,
// the PyTorch-format export and the safetensors export hold the whole, unpermuted tensors. A
// checkpoint saved at (dp 2, tp 2) loads at (dp 4, tp 1), (dp 1, tp 4) with the vocabulary split
// and whole, (dp 2, tp 2) whole and W=1, and theirs load back at (2, 2).
TEST(TensorParallel, StateDictsAndCheckpointsAcrossLayouts) {
  const std::string root = fsdp::testing::shared_temp_path("tp_ckpt");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(root);
  const CheckpointLayout saved{2, 2, true};
  run_distributed(4, [&] {
    auto model = build_layout(saved);
    fsdp::load_full_state_dict(*model, other_values());
    const fsdp::ShardedStateDict sharded = fsdp::sharded_state_dict(*model);
    const std::vector<fsdp::Placement> column{fsdp::StridedShard(0, 2), fsdp::Shard(0)};
    EXPECT_EQ(sharded["layers.0.attention.wq.weight"].placements(), column);
    EXPECT_EQ(sharded["tok_embeddings.weight"].placements(), column);
    EXPECT_EQ(sharded["output.weight"].placements(), column);
    EXPECT_EQ(sharded["layers.0.feed_forward.w2.weight"].placements(),
              (std::vector<fsdp::Placement>{fsdp::Shard(0), fsdp::Shard(1)}));
    EXPECT_EQ(sharded["pos_embeddings.weight"].placements(),
              (std::vector<fsdp::Placement>{fsdp::Shard(0), fsdp::Replicate()}));
    expect_values(fsdp::full_state_dict(*model), other_values(), "full_state_dict at " + saved.name());
    fsdp::save_checkpoint(root + "/" + saved.name(), sharded);
    fsdp::save_safetensors(sharded, root + "/safetensors");
    const auto full = fsdp::full_state_dict(*model, fsdp::FullStateDictOptions().rank0_only(true));
    if (fsdp::get_rank() == 0) fsdp::save_pytorch_state_dict(full, root + "/export.pt");
  });
  if (!fsdp::testing::is_child()) {
    expect_values(fsdp::load_pytorch_state_dict(root + "/export.pt"), other_values(), "PyTorch-format export");
  }
  const std::vector<CheckpointLayout> layouts = {{4, 1}, {1, 4, true}, {1, 4, false}, {2, 2, false}, {1, 1}};
  for (const CheckpointLayout& layout : layouts) {
    run_distributed(layout.world(), [&] {
      auto model = build_layout(layout);
      fsdp::load_sharded_state_dict(*model,
                                    fsdp::load_checkpoint(root + "/" + saved.name(), fsdp::sharded_state_dict(*model)));
      expect_values(fsdp::full_state_dict(*model), other_values(), saved.name() + " -> " + layout.name());
      fsdp::save_checkpoint(root + "/" + layout.name(), fsdp::sharded_state_dict(*model));
      if (layout.world() == 1) {
        auto again = build_layout(layout);
        fsdp::load_sharded_state_dict(*again,
                                      fsdp::load_safetensors(root + "/safetensors", fsdp::sharded_state_dict(*again)));
        expect_values(fsdp::full_state_dict(*again), other_values(), "safetensors export");
      }
    });
  }
  for (const CheckpointLayout& layout : layouts) {
    run_distributed(saved.world(), [&] {
      auto model = build_layout(saved);
      fsdp::load_sharded_state_dict(
          *model, fsdp::load_checkpoint(root + "/" + layout.name(), fsdp::sharded_state_dict(*model)));
      expect_values(fsdp::full_state_dict(*model), other_values(), layout.name() + " -> " + saved.name());
    });
  }
}

// Tensor parallelism without fully_shard: the state dicts show the tp placements, the full state
// dict and the optimizer's hold whole tensors, and a checkpoint saved at tp 2 loads at
// dp 2 x tp 2 with the vocabulary split.
TEST(TensorParallel, StateDictsOfAModelNotPassedToFullyShard) {
  const std::string root = fsdp::testing::shared_temp_path("tp_only_ckpt");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(root);
  run_distributed(2, [&] {
    auto model = seeded_model(checkpoint_args());
    models::parallelize(model, tp::TensorParallelMesh(fsdp::init_device_mesh("cpu", {2})));
    fsdp::load_full_state_dict(*model, other_values());
    const fsdp::ShardedStateDict sharded = fsdp::sharded_state_dict(*model);
    EXPECT_EQ(sharded["layers.0.attention.wq.weight"].placements(), std::vector<fsdp::Placement>{fsdp::Shard(0)});
    EXPECT_EQ(sharded["layers.0.feed_forward.w2.weight"].placements(), std::vector<fsdp::Placement>{fsdp::Shard(1)});
    EXPECT_EQ(sharded["output.weight"].placements(), std::vector<fsdp::Placement>{fsdp::Replicate()});
    expect_values(fsdp::full_state_dict(*model), other_values(), "full_state_dict at tp 2");
    fsdp::save_checkpoint(root + "/tp2", sharded);

    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    lm_loss(model, step_tokens(0, 2, 8, 12)).backward();
    opt.step();
    const fsdp::ShardedStateDict optim = fsdp::sharded_optimizer_state_dict(*model, opt);
    EXPECT_EQ(optim["state.layers.0.attention.wq.weight.exp_avg"].sizes(), (std::vector<int64_t>{12, 12}));
    EXPECT_EQ(optim["state.layers.0.attention.wq.weight.exp_avg"].to_local().size(0), 6);
  });
  run_distributed(4, [&] {
    auto model = build_layout({2, 2, true});
    fsdp::load_sharded_state_dict(*model, fsdp::load_checkpoint(root + "/tp2", fsdp::sharded_state_dict(*model)));
    expect_values(fsdp::full_state_dict(*model), other_values(), "tp 2 -> dp2 x tp2");
  });
}
