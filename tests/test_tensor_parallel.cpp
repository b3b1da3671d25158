// Tensor parallelism (fsdp/tensor_parallel.h) across real processes: the column- and
// row-parallel Linear layers against a whole Linear, parallelize on the reference Transformer
// trained at tp 2 and 4 against one process on the same batch (losses and full parameters),
// its layouts, its state dicts and checkpoints (with and without fully_shard), and its errors.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor_parameter.h>
#include <fsdp/fully_shard.h>
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

namespace {

fsdp::models::ModelArgs tp_args(int64_t dim, int64_t n_heads) {
  fsdp::models::ModelArgs args;
  args.n_layers = 2;
  args.vocab_size = 7;
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
                   const std::string& what, double max_norm = 0.0, int steps = 3, int64_t rows_per_dp = 2) {
  const fsdp::models::ModelArgs& args = reference->args();
  const int64_t dp = layout.tp_dim.empty() ? 1 : layout.mesh.size(0);
  const int64_t dp_rank = layout.tp_dim.empty() ? 0 : layout.mesh.get_local_rank(0);
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < steps; ++step) {
    const at::Tensor global = step_tokens(step, rows_per_dp * dp, args.max_seq_len, args.vocab_size);
    ref_opt.zero_grad();
    at::Tensor ref_loss = lm_loss(reference, global);
    ref_loss.backward();
    const double ref_norm = max_norm > 0 ? fsdp::clip_grad_norm_(reference->parameters(), max_norm) : 0.0;
    ref_opt.step();

    opt.zero_grad();
    at::Tensor loss = lm_loss(model, global.narrow(0, dp_rank * rows_per_dp, rows_per_dp));
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
      const std::vector<std::pair<at::Tensor, at::Tensor>> pairs = {{col->weight, fc1->weight}, {col->bias, fc1->bias},
                                                                   {row->weight, fc2->weight}, {row->bias, fc2->bias}};
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
      tp::parallelize(model, tp::TensorParallelMesh(mesh));
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
// column-parallel group input (the attention's x, used by wq, wk and wv, and w1's input).
TEST(TensorParallel, AllReducesPerBlock) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto model = seeded_model(tp_args(12, 4));
    tp::parallelize(model, tp::TensorParallelMesh(mesh));
    auto group = mesh.get_group(0);
    const at::Tensor tokens = step_tokens(0, 2, 8, 7);
    group->reset_stats();
    at::Tensor loss = lm_loss(model, tokens);
    const int64_t blocks = model->args().n_layers;
    EXPECT_EQ(group->stats()[fsdp::CollectiveKind::kAllReduce].calls, 2 * blocks);
    loss.backward();
    // wq, wk and wv each send their input gradient (3) and w1 its (1).
    EXPECT_EQ(group->stats()[fsdp::CollectiveKind::kAllReduce].calls, 2 * blocks + 4 * blocks);
    EXPECT_EQ(group->stats().total_calls(), 6 * blocks);
  });
}

TEST(TensorParallel, HeadsNotDivisibleByTpAreRejected) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {4});
    auto model = seeded_model(tp_args(6, 2));
    try {
      tp::parallelize(model, tp::TensorParallelMesh(mesh));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("n_heads=2 is not divisible by the tensor-parallel size 4"),
                std::string::npos) << e.what();
    }
  });
  EXPECT_THROW(tp::check_parallelizable(12, 12, 5), c10::Error);
  EXPECT_NO_THROW(tp::check_parallelizable(12, 12, 3));
}

// ------------------------------------------------------------------ FSDP over tensor parallelism

namespace {

fsdp::FullyShardOptions dp_tp_options(const fsdp::DeviceMesh& mesh) {
  return fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(fsdp::DataParallelMeshDims().shard("dp"));
}

// The model split over tp, then each block and the root sharded over dp.
void parallelize_and_shard(fsdp::models::Transformer& model, const fsdp::DeviceMesh& mesh) {
  tp::parallelize(model, tp::TensorParallelMesh(mesh, "tp"));
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

// The dp group carries FSDP's all-gathers and reduce-scatters only, the tp group the blocks'
// all-reduces only: 2 per block in forward (wo, w2), 4 in backward (wq, wk, wv, w1 inputs).
TEST(TensorParallel, FsdpOverTpCollectivesStayOnTheirGroups) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    auto model = seeded_model(tp_args(6, 2));
    parallelize_and_shard(model, mesh);
    auto dp = mesh.get_group("dp"), tpg = mesh.get_group("tp");
    const int64_t blocks = model->args().n_layers, groups = blocks + 1;
    for (int iteration = 0; iteration < 2; ++iteration) {
      dp->reset_stats();
      tpg->reset_stats();
      lm_loss(model, step_tokens(iteration, 2, 8, 7)).backward();
      const fsdp::CollectiveStats d = dp->stats(), t = tpg->stats();
      // Forward gathers every group; backward gathers the blocks again (the root keeps its
      // parameters from forward to backward); backward reduce-scatters every group.
      EXPECT_EQ(d[fsdp::CollectiveKind::kAllGather].calls, groups + blocks);
      EXPECT_EQ(d[fsdp::CollectiveKind::kReduceScatter].calls, groups);
      EXPECT_EQ(d[fsdp::CollectiveKind::kAllReduce].calls, 0);
      EXPECT_EQ(d.total_calls(), groups + blocks + groups);
      EXPECT_EQ(t[fsdp::CollectiveKind::kAllReduce].calls, 6 * blocks);
      EXPECT_EQ(t.total_calls(), 6 * blocks);
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
    expect_error([&] {
      fsdp::fully_shard(torch::nn::Linear(4, 4).ptr(),
                        fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(fsdp::DataParallelMeshDims()));
    }, "needs at least one of shard or replicate");
    expect_error([&] {
      fsdp::fully_shard(torch::nn::Linear(4, 4).ptr(), fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(
                                                          fsdp::DataParallelMeshDims().shard("dp").replicate("r")));
    }, "not supported yet");
    expect_error([&] { fsdp::fully_shard(torch::nn::Linear(4, 4).ptr(), dp_tp_options(mesh).reshard_after_forward(2)); },
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

// The Transformer at dp x tp (W = dp * tp): TP over a (dp, tp) mesh with FSDP over dp; plain
// FSDP on a 1-D mesh for tp 1.
fsdp::models::Transformer build_layout(int64_t dp, int64_t tp_size) {
  auto model = seeded_model(tp_args(12, 4));
  if (tp_size == 1) {
    auto mesh = fsdp::init_device_mesh("cpu", {dp});
    for (auto& block : model->blocks()) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh));
    fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
  } else {
    parallelize_and_shard(model, fsdp::init_device_mesh("cpu", {dp, tp_size}, {"dp", "tp"}));
  }
  return model;
}

// Values different from the seeded model's, the same on every rank.
fsdp::TensorStateDict other_values() {
  torch::manual_seed(11);
  fsdp::models::Transformer m(tp_args(12, 4));
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

std::string layout_name(int64_t dp, int64_t tp_size) { return "dp" + std::to_string(dp) + "tp" + std::to_string(tp_size); }

}  // namespace

// The state dicts of dp2 x tp2 show both placements, and the full state dict, the PyTorch-format
// export and the safetensors export hold the whole, unpermuted tensors. A checkpoint saved at
// (dp 2, tp 2) loads at (dp 4, tp 1), (dp 1, tp 4) and W=1, and theirs load back at (2, 2).
TEST(TensorParallel, StateDictsAndCheckpointsAcrossLayouts) {
  const std::string root = fsdp::testing::shared_temp_path("tp_ckpt");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(root);
  run_distributed(4, [&] {
    auto model = build_layout(2, 2);
    fsdp::load_full_state_dict(*model, other_values());
    const fsdp::ShardedStateDict sharded = fsdp::sharded_state_dict(*model);
    EXPECT_EQ(sharded["layers.0.attention.wq.weight"].placements(),
              (std::vector<fsdp::Placement>{fsdp::StridedShard(0, 2), fsdp::Shard(0)}));
    EXPECT_EQ(sharded["layers.0.feed_forward.w2.weight"].placements(),
              (std::vector<fsdp::Placement>{fsdp::Shard(0), fsdp::Shard(1)}));
    EXPECT_EQ(sharded["tok_embeddings.weight"].placements(),
              (std::vector<fsdp::Placement>{fsdp::Shard(0), fsdp::Replicate()}));
    expect_values(fsdp::full_state_dict(*model), other_values(), "full_state_dict at dp2 x tp2");
    fsdp::save_checkpoint(root + "/dp2tp2", sharded);
    fsdp::save_safetensors(sharded, root + "/safetensors");
    const auto full = fsdp::full_state_dict(*model, fsdp::FullStateDictOptions().rank0_only(true));
    if (fsdp::get_rank() == 0) fsdp::save_pytorch_state_dict(full, root + "/export.pt");
  });
  if (!fsdp::testing::is_child()) {
    expect_values(fsdp::load_pytorch_state_dict(root + "/export.pt"), other_values(), "PyTorch-format export");
  }
  const std::vector<std::pair<int64_t, int64_t>> layouts = {{4, 1}, {1, 4}, {1, 1}};
  for (const auto& [dp, tp_size] : layouts) {
    const std::string name = layout_name(dp, tp_size);
    run_distributed(static_cast<int>(dp * tp_size), [&, dp = dp, tp_size = tp_size, name] {
      auto model = build_layout(dp, tp_size);
      fsdp::load_sharded_state_dict(*model, fsdp::load_checkpoint(root + "/dp2tp2", fsdp::sharded_state_dict(*model)));
      expect_values(fsdp::full_state_dict(*model), other_values(), "dp2 x tp2 -> " + name);
      fsdp::save_checkpoint(root + "/" + name, fsdp::sharded_state_dict(*model));
      if (dp * tp_size == 1) {
        auto again = build_layout(1, 1);
        fsdp::load_sharded_state_dict(*again, fsdp::load_safetensors(root + "/safetensors", fsdp::sharded_state_dict(*again)));
        expect_values(fsdp::full_state_dict(*again), other_values(), "safetensors export");
      }
    });
  }
  for (const auto& [dp, tp_size] : layouts) {
    const std::string name = layout_name(dp, tp_size);
    run_distributed(4, [&, name] {
      auto model = build_layout(2, 2);
      fsdp::load_sharded_state_dict(*model, fsdp::load_checkpoint(root + "/" + name, fsdp::sharded_state_dict(*model)));
      expect_values(fsdp::full_state_dict(*model), other_values(), name + " -> dp2 x tp2");
    });
  }
}

// Tensor parallelism without fully_shard: the state dicts show the tp placements, the full state
// dict and the optimizer's hold whole tensors, and a checkpoint saved at tp 2 loads at
// dp 2 x tp 2.
TEST(TensorParallel, StateDictsOfAModelNotPassedToFullyShard) {
  const std::string root = fsdp::testing::shared_temp_path("tp_only_ckpt");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(root);
  run_distributed(2, [&] {
    auto model = seeded_model(tp_args(12, 4));
    tp::parallelize(model, tp::TensorParallelMesh(fsdp::init_device_mesh("cpu", {2})));
    fsdp::load_full_state_dict(*model, other_values());
    const fsdp::ShardedStateDict sharded = fsdp::sharded_state_dict(*model);
    EXPECT_EQ(sharded["layers.0.attention.wq.weight"].placements(), std::vector<fsdp::Placement>{fsdp::Shard(0)});
    EXPECT_EQ(sharded["layers.0.feed_forward.w2.weight"].placements(), std::vector<fsdp::Placement>{fsdp::Shard(1)});
    EXPECT_EQ(sharded["output.weight"].placements(), std::vector<fsdp::Placement>{fsdp::Replicate()});
    expect_values(fsdp::full_state_dict(*model), other_values(), "full_state_dict at tp 2");
    fsdp::save_checkpoint(root + "/tp2", sharded);

    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    lm_loss(model, step_tokens(0, 2, 8, 7)).backward();
    opt.step();
    const fsdp::ShardedStateDict optim = fsdp::sharded_optimizer_state_dict(*model, opt);
    EXPECT_EQ(optim["state.layers.0.attention.wq.weight.exp_avg"].sizes(), (std::vector<int64_t>{12, 12}));
    EXPECT_EQ(optim["state.layers.0.attention.wq.weight.exp_avg"].to_local().size(0), 6);
  });
  run_distributed(4, [&] {
    auto model = build_layout(2, 2);
    fsdp::load_sharded_state_dict(*model, fsdp::load_checkpoint(root + "/tp2", fsdp::sharded_state_dict(*model)));
    expect_values(fsdp::full_state_dict(*model), other_values(), "tp 2 -> dp2 x tp2");
  });
}
