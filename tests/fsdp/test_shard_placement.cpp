// fully_shard with a shard_placement_fn: parameters sharded along dims other than 0. The buffer
// layouts in one process, then real processes: parity with single-process training, the same
// training as Shard(0) under every feature that touches the layouts, the errors, the DTensor
// views, state dicts and checkpoints that move between shard dims.
#include "harness/multiprocess.h"

#include "src/fsdp/collectives.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>

namespace fs = std::filesystem;
using fsdp::testing::run_distributed;

namespace {

// Largest dims of the parameters: l1.weight [4, 12] (dim 1), l2.weight [10, 4] (dim 0),
// l3.weight [2, 10] (dim 1; 10 splits over 2 ranks only), proj [3, 2, 12] (dim 2),
// head.weight [1, 12] (dim 1); biases are 1-D.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", torch::nn::Linear(12, 4));
    l2 = register_module("l2", torch::nn::Linear(4, 10));
    l3 = register_module("l3", torch::nn::Linear(10, 2));
    proj = register_parameter("proj", at::randn({3, 2, 12}) * 0.3);
    head = register_module("head", torch::nn::Linear(12, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(fsdp::call(l1, x));
    h = at::tanh(fsdp::call(l2, h));
    h = fsdp::call(l3, h);
    h = at::relu(at::einsum("bi,kij->bj", {h, proj}));
    return fsdp::call(head, h);
  }
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, head{nullptr};
  at::Tensor proj;
};
TORCH_MODULE(Net);

Net make_net(uint64_t seed = 0) {
  torch::manual_seed(seed);
  return Net();
}

at::Tensor batch_of(int64_t step, int64_t rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
  return at::randn({rows, 12}, gen);
}

at::Tensor loss_of(const at::Tensor& out, const at::Tensor& x) {
  return (out.to(at::kFloat) - x.sum(1, true)).pow(2).mean();
}

// Shard(largest dim) where it splits evenly over `shard_world`, else the default Shard(0).
fsdp::ShardPlacementFn largest_dim(int64_t shard_world) {
  return [shard_world](const std::string&, const at::Tensor& p) -> std::optional<fsdp::Placement> {
    int64_t best = 0;
    for (int64_t d = 1; d < p.dim(); ++d) {
      if (p.size(d) > p.size(best)) best = d;
    }
    if (best == 0 || p.size(best) % shard_world != 0) return std::nullopt;
    return fsdp::Shard(best);
  };
}

struct Config {
  std::string name;
  fsdp::DeviceMesh mesh;  // invalid: the default world mesh
  fsdp::MixedPrecisionPolicy mp;
  std::optional<fsdp::CPUOffloadPolicy> offload;
  fsdp::ReshardAfterForward reshard_after_forward;
  bool accumulate = false;  // two micro-batches per step, the first without gradient sync
  double tolerance = 1e-5;
};

int64_t shard_world_of(const Config& c) {
  return c.mesh.valid() ? c.mesh.size(c.mesh.ndim() - 1) : fsdp::get_world_size();
}

// fully_shard on l1, l2, l3, then the root (proj, head), with `placement_fn` (may be empty).
Net make_sharded(const Config& c, const fsdp::ShardPlacementFn& placement_fn, uint64_t seed = 0) {
  Net net = make_net(seed);
  auto opts = fsdp::FullyShardOptions()
                  .mp_policy(c.mp)
                  .offload_policy(c.offload)
                  .reshard_after_forward(c.reshard_after_forward)
                  .shard_placement_fn(placement_fn);
  if (c.mesh.valid()) opts.mesh(c.mesh);
  for (auto layer : {net->l1, net->l2, net->l3}) fsdp::fully_shard(layer, opts);
  fsdp::fully_shard(net, opts);
  return net;
}

// One step of a sharded model on this rank's rows of the global batch; returns the mean loss
// over the ranks and the gradient norm (before clipping to 0.5).
std::pair<double, double> sharded_step(Net& net, torch::optim::Adam& opt, const Config& c, int64_t step) {
  const int W = fsdp::get_world_size(), r = fsdp::get_rank();
  const int64_t rows = 4;
  at::Tensor local = batch_of(step, rows * W).slice(0, r * rows, (r + 1) * rows);
  opt.zero_grad();
  at::Tensor loss;
  if (c.accumulate) {
    fsdp::FSDPModule root = fsdp::get_fsdp_module(*net);
    root.set_requires_gradient_sync(false);
    at::Tensor first = local.slice(0, 0, rows / 2);
    (loss_of(fsdp::call(net, first), first) * 0.5).backward();
    root.set_requires_gradient_sync(true);
    at::Tensor second = local.slice(0, rows / 2);
    loss = loss_of(fsdp::call(net, second), second) * 0.5;
  } else {
    loss = loss_of(fsdp::call(net, local), local);
  }
  loss.backward();
  const double norm = fsdp::clip_grad_norm_(net->parameters(), 0.5);
  opt.step();
  at::Tensor mean = loss.detach().clone().reshape({1});
  fsdp::world()->all_reduce(mean, fsdp::ReduceOp::kAvg)->wait();
  return {mean.item<double>(), norm};
}

// Every parameter of `net`, whole (collective).
std::map<std::string, at::Tensor> full_params(Net& net) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : net->named_parameters()) out[item.key()] = fsdp::as_dtensor(item.value()).full_tensor();
  return out;
}

void expect_close(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                  double tolerance, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [key, t] : a) {
    ASSERT_TRUE(b.count(key)) << what << ": " << key;
    ASSERT_EQ(t.sizes(), b.at(key).sizes()) << what << ": " << key;
    EXPECT_LE((t.to(at::kDouble) - b.at(key).to(at::kDouble)).abs().max().item<double>(), tolerance)
        << what << ": " << key;
  }
}

// The placements the largest-dim rule gives each parameter of a Net over `shard_world` ranks.
std::map<std::string, int64_t> expected_dims(int64_t shard_world) {
  Net net = make_net();
  const auto fn = largest_dim(shard_world);
  std::map<std::string, int64_t> out;
  for (const auto& item : net->named_parameters()) {
    const auto p = fn(item.key(), item.value());
    out[item.key()] = p ? p->dim() : 0;
  }
  return out;
}

// Trains under FSDP with the largest-dim placements and an unsharded reference on the whole
// global batch side by side: losses, gradient norms and parameters agree.
void expect_parity_with_reference() {
  const int W = fsdp::get_world_size();
  Config c;
  Net reference = make_net();
  Net net = make_sharded(c, largest_dim(W));
  const auto dims = expected_dims(W);
  for (const auto& item : net->named_parameters()) {
    const fsdp::DTensor d = fsdp::as_dtensor(item.value());
    EXPECT_EQ(d.placements(), std::vector<fsdp::Placement>{fsdp::Shard(dims.at(item.key()))}) << item.key();
  }
  torch::optim::Adam ref_opt(reference->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 4; ++step) {
    at::Tensor global = batch_of(step, 4 * W);
    ref_opt.zero_grad();
    at::Tensor ref_loss = loss_of(reference->forward(global), global);
    ref_loss.backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.5);
    ref_opt.step();
    const auto [loss, norm] = sharded_step(net, opt, c, step);
    EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-5) << "W=" << W << " step " << step;
    EXPECT_NEAR(norm, ref_norm, 1e-5) << "W=" << W << " step " << step;
  }
  std::map<std::string, at::Tensor> expect;
  for (const auto& item : reference->named_parameters()) expect[item.key()] = item.value().detach();
  expect_close(full_params(net), expect, 1e-5, "W=" + std::to_string(W));
}

// The same training with and without the placements: the layouts must not change the numbers.
void expect_same_as_shard_zero(const Config& c) {
  Net placed = make_sharded(c, largest_dim(shard_world_of(c)));
  Net plain = make_sharded(c, nullptr);
  torch::optim::Adam placed_opt(placed->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam plain_opt(plain->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    const auto a = sharded_step(placed, placed_opt, c, step);
    const auto b = sharded_step(plain, plain_opt, c, step);
    EXPECT_NEAR(a.first, b.first, c.tolerance) << c.name << " step " << step;
    EXPECT_NEAR(a.second, b.second, c.tolerance) << c.name << " step " << step;
  }
  expect_close(full_params(placed), full_params(plain), c.tolerance, c.name);
}

// Runs `f` and expects a c10::Error whose message contains every needle.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "no '" << n << "' in: " << msg;
    return;
  }
  ADD_FAILURE() << "no error; expected one containing '" << needles.front() << "'";
}

// fully_shard on a Linear(in, out) alone with `fn` choosing `placement` for its weight.
void shard_linear(int64_t in, int64_t out, std::optional<fsdp::Placement> placement) {
  torch::nn::Linear l(in, out);
  fsdp::fully_shard(l, fsdp::FullyShardOptions().shard_placement_fn(
                           [placement](const std::string& fqn, const at::Tensor&) -> std::optional<fsdp::Placement> {
                             return fqn == "weight" ? placement : std::nullopt;
                           }));
}

// The model and optimizer state of a Net, under one dict (as a trainer saves them).
fsdp::ShardedStateDict state_of(Net& net, torch::optim::Optimizer& opt) {
  fsdp::ShardedStateDict sd;
  for (const auto& item : fsdp::sharded_state_dict(*net)) sd.insert("model." + item.key(), item.value());
  for (const auto& item : fsdp::sharded_optimizer_state_dict(*net, opt)) sd.insert("optim." + item.key(), item.value());
  return sd;
}

void load_state(Net& net, torch::optim::Optimizer& opt, const fsdp::ShardedStateDict& sd) {
  fsdp::ShardedStateDict model_part, optim_part;
  for (const auto& item : sd) {
    if (item.key().rfind("model.", 0) == 0) model_part.insert(item.key().substr(6), item.value());
    else optim_part.insert(item.key().substr(6), item.value());
  }
  fsdp::load_sharded_state_dict(*net, model_part);
  fsdp::load_sharded_optimizer_state_dict(*net, opt, optim_part);
}

// Every tensor of a state dict, whole (collective).
std::map<std::string, at::Tensor> full_values(const fsdp::ShardedStateDict& sd) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : sd) out[item.key()] = item.value().full_tensor();
  return out;
}

void remove_in_parent(const std::string& dir) {
  if (!fsdp::testing::is_child()) fs::remove_all(dir);
}

}  // namespace

// One process plays 4 ranks of a Shard(1) weight [3, 8] and a Shard(2) tensor [2, 3, 4]: each
// rank's flat shard is its torch.chunk piece, contiguous; the all-gather copy-out rebuilds the
// tensors; the reduce-scatter input's row q is piece q of each gradient (also through a cast).
TEST(ShardPlacement, LayoutsCutAndRebuildAlongTheShardDim) {
  constexpr int64_t W = 4;
  const at::Tensor weight = at::arange(24, at::kFloat).reshape({3, 8});
  const at::Tensor cube = at::arange(24, at::kFloat).reshape({2, 3, 4}) + 100;
  auto params_of = [&](int64_t rank) {
    fsdp::detail::FSDPParams params;
    params.push_back(
        std::make_unique<fsdp::detail::FSDPParam>("weight", weight.clone().set_requires_grad(true), W, rank));
    params.push_back(std::make_unique<fsdp::detail::FSDPParam>("cube", cube.clone().set_requires_grad(true), W, rank));
    params[0]->shard_on(1);
    params[1]->shard_on(-1);
    return params;
  };
  std::vector<fsdp::detail::FSDPParams> ranks;
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < W; ++r) {
    ranks.push_back(params_of(r));
    const auto layout = fsdp::detail::shard_layout(ranks.back(), W);
    EXPECT_EQ(layout.piece_numel, (std::vector<int64_t>{6, 6}));
    EXPECT_EQ(layout.runs, (std::vector<int64_t>{3, 6}));
    rows.push_back(fsdp::detail::init_flat_shard(ranks.back(), layout));
    EXPECT_EQ(ranks.back()[1]->shard_dim(), 2);
    EXPECT_TRUE(ranks.back()[0]->sharded().equal(weight.chunk(W, 1)[r])) << "rank " << r;
    EXPECT_TRUE(ranks.back()[1]->sharded().equal(cube.chunk(W, 2)[r])) << "rank " << r;
    EXPECT_TRUE(ranks.back()[0]->sharded().is_contiguous());
  }
  // All-gather copy-out on rank 1.
  auto& mine = ranks[1];
  const auto layout = fsdp::detail::shard_layout(mine, W);
  for (auto& p : mine) {
    p->free_unsharded();
    p->alloc_unsharded();
  }
  fsdp::detail::foreach_all_gather_copy_out(
      fsdp::detail::AllGatherResult{nullptr, at::cat(rows), layout, std::nullopt, std::nullopt}, mine);
  EXPECT_TRUE(mine[0]->unsharded().equal(weight));
  EXPECT_TRUE(mine[1]->unsharded().equal(cube));
  // An empty dim before the shard dim: nothing in any piece.
  fsdp::detail::FSDPParams empty;
  empty.push_back(std::make_unique<fsdp::detail::FSDPParam>("empty", at::zeros({0, 4}), W, 0));
  empty[0]->shard_on(1);
  const auto empty_layout = fsdp::detail::shard_layout(empty, W);
  EXPECT_EQ(empty_layout.row_numel, 0);
  fsdp::detail::init_flat_shard(empty, empty_layout);
  EXPECT_EQ(empty[0]->sharded().sizes(), (std::vector<int64_t>{0, 1}));
  // Reduce-scatter copy-in, in the gradients' dtype and widened to double.
  for (at::ScalarType reduce_dtype : {at::kFloat, at::kDouble}) {
    mine[0]->unsharded().mutable_grad() = weight * 2;
    mine[1]->unsharded().mutable_grad() = cube * 3;
    const at::Tensor input =
        fsdp::detail::foreach_reduce_copy_in(mine, {0, 1}, layout, reduce_dtype).reshape({W, layout.row_numel});
    for (int64_t q = 0; q < W; ++q) {
      const at::Tensor expect = at::cat({(weight * 2).chunk(W, 1)[q].flatten(), (cube * 3).chunk(W, 2)[q].flatten()});
      EXPECT_TRUE(input[q].equal(expect.to(reduce_dtype))) << "row " << q << " in " << reduce_dtype;
    }
  }
}

TEST(ShardPlacement, ParityWithSingleProcessTraining) {
  for (int world : {2, 3, 4}) run_distributed(world, [] { expect_parity_with_reference(); });
}

// Mixed precision, CPU offload, reshard_after_forward as an int, HSDP and gradient
// accumulation without sync: Shard(largest dim) trains exactly as Shard(0).
TEST(ShardPlacement, EveryFeatureTrainsAsShardZero) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size();
      Config mp;
      mp.name = "mixed precision";
      mp.mp = fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
      expect_same_as_shard_zero(mp);
      Config offload;
      offload.name = "cpu offload";
      offload.offload = fsdp::CPUOffloadPolicy().pin_memory(false);
      expect_same_as_shard_zero(offload);
      Config accumulate;
      accumulate.name = "no-sync accumulation";
      accumulate.accumulate = true;
      expect_same_as_shard_zero(accumulate);
      Config keep;
      keep.name = "reshard_after_forward false";
      keep.reshard_after_forward = false;
      expect_same_as_shard_zero(keep);
      if (W == 4) {
        Config partial;
        partial.name = "reshard_after_forward 2";
        partial.reshard_after_forward = 2;
        expect_same_as_shard_zero(partial);
        Config hsdp;
        hsdp.name = "hsdp 2x2";
        hsdp.mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
        expect_same_as_shard_zero(hsdp);
        hsdp.name = "hsdp 2x2 with accumulation";
        hsdp.accumulate = true;
        expect_same_as_shard_zero(hsdp);
      }
    });
  }
}

TEST(ShardPlacement, BadPlacementsFailNamingTheParameter) {
  run_distributed(2, [] {
    // Linear(3, 4): weight [4, 3]; 3 does not split over 2 ranks.
    expect_error([] { shard_linear(3, 4, fsdp::Shard(1)); },
                 {"FSDP does not support uneven sharding on dim 1", "'weight'", "[4, 3]", "size 3"});
    expect_error([] { shard_linear(3, 4, fsdp::Shard(-1)); }, {"uneven sharding on dim 1", "'weight'"});
    expect_error([] { shard_linear(4, 4, fsdp::Shard(2)); }, {"Shard(2)", "'weight'", "[4, 4]", "2-D tensor"});
    expect_error([] { shard_linear(4, 4, fsdp::Shard(-3)); }, {"Shard(-3)", "'weight'", "2-D tensor"});
    expect_error([] { shard_linear(4, 4, fsdp::Replicate()); }, {"Replicate()", "'weight'", "Shard(d)"});
    // Dim 0 may be uneven (it is padded), and a negative dim counts from the end.
    torch::nn::Linear uneven(4, 3);
    fsdp::fully_shard(uneven, fsdp::FullyShardOptions().shard_placement_fn(
                                  [](const std::string&, const at::Tensor&) { return fsdp::Shard(0); }));
    EXPECT_EQ(fsdp::as_dtensor(uneven->weight).placements()[0], fsdp::Shard(0));
    torch::nn::Linear last(6, 4);
    fsdp::fully_shard(last, fsdp::FullyShardOptions().shard_placement_fn(
                                [](const std::string&, const at::Tensor& p) -> std::optional<fsdp::Placement> {
                                  if (p.dim() == 1) return std::nullopt;
                                  return fsdp::Shard(-1);
                                }));
    EXPECT_EQ(fsdp::as_dtensor(last->weight).placements()[0], fsdp::Shard(1));
    EXPECT_EQ(fsdp::as_dtensor(last->bias).placements()[0], fsdp::Shard(0));
  });
}

// as_dtensor: Shard(d), the global shape, this rank's torch.chunk piece; full_tensor and
// redistribute give the whole tensor and other layouts; under HSDP (Replicate(), Shard(d)).
// State dicts: the sharded one carries the placements, the full one equals the unsharded model,
// and a full state dict loads back into the shards.
TEST(ShardPlacement, DTensorViewsAndStateDicts) {
  for (int world : {2, 3, 4}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      Net reference = make_net();
      Net net = make_sharded(Config(), largest_dim(W));
      auto ref_params = reference->named_parameters();
      const auto dims = expected_dims(W);
      for (const auto& item : net->named_parameters()) {
        const at::Tensor& whole = ref_params[item.key()];
        const fsdp::DTensor d = fsdp::as_dtensor(item.value());
        const int64_t dim = dims.at(item.key());
        EXPECT_EQ(d.placements(), std::vector<fsdp::Placement>{fsdp::Shard(dim)}) << item.key();
        EXPECT_EQ(d.sizes(), whole.sizes().vec()) << item.key();
        const auto chunks = whole.chunk(W, dim);
        const at::Tensor piece = r < static_cast<int>(chunks.size()) ? chunks[r] : whole.narrow(dim, 0, 0);
        EXPECT_TRUE(d.to_local().equal(piece)) << item.key();
        EXPECT_TRUE(d.full_tensor().equal(whole)) << item.key();
        EXPECT_TRUE(d.redistribute({fsdp::Replicate()}).to_local().equal(whole)) << item.key();
        EXPECT_TRUE(d.redistribute({fsdp::Shard(0)}).full_tensor().equal(whole)) << item.key();
      }
      // The module's member (the unsharded face) gives the same view.
      EXPECT_EQ(fsdp::as_dtensor(net->l1->weight).placements()[0], fsdp::Shard(dims.at("l1.weight")));

      const fsdp::ShardedStateDict sharded = fsdp::sharded_state_dict(*net);
      EXPECT_EQ(sharded.find("proj")->placements()[0], fsdp::Shard(2));
      const fsdp::TensorStateDict full = fsdp::full_state_dict(*net);
      for (const auto& item : reference->named_parameters()) {
        ASSERT_NE(full.find(item.key()), nullptr) << item.key();
        EXPECT_TRUE(full.find(item.key())->equal(item.value())) << item.key();
      }
      // A full state dict of other values loads into the shards.
      Net other = make_net(7);
      fsdp::TensorStateDict other_full;
      for (const auto& item : other->named_parameters()) other_full.insert(item.key(), item.value().detach());
      fsdp::load_full_state_dict(*net, other_full);
      for (const auto& [key, t] : full_params(net)) EXPECT_TRUE(t.equal(*other_full.find(key))) << key;

      // HSDP: the replicate dim first.
      if (W == 4) {
        Config hsdp;
        hsdp.mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
        Net h = make_sharded(hsdp, largest_dim(2));
        const fsdp::DTensor d = fsdp::as_dtensor(h->l3->weight);  // [2, 10]: 10 splits over 2
        EXPECT_EQ(d.placements(), (std::vector<fsdp::Placement>{fsdp::Replicate(), fsdp::Shard(1)}));
        EXPECT_TRUE(d.to_local().equal(ref_params["l3.weight"].chunk(2, 1)[r % 2]));
        EXPECT_TRUE(d.full_tensor().equal(ref_params["l3.weight"]));
      }
    });
  }
}

// Model and Adam state saved with Shard(largest dim) load into Shard(0) models and back, at the
// same world size and at another: the values are equal, and training goes on identically. A
// safetensors export loads back into Shard(d) pieces.
TEST(ShardPlacement, CheckpointsMoveBetweenShardDims) {
  const std::string root = fsdp::testing::shared_temp_path("placement_ckpt");
  remove_in_parent(root);
  for (int world : {2, 3}) {
    run_distributed(world, [root] {
      const int W = fsdp::get_world_size();
      const std::string tag = "_w" + std::to_string(W);
      Config c;
      Net placed = make_sharded(c, largest_dim(W));
      torch::optim::Adam placed_opt(placed->parameters(), torch::optim::AdamOptions(1e-2));
      for (int step = 0; step < 2; ++step) sharded_step(placed, placed_opt, c, step);
      const fsdp::ShardedStateDict placed_state = state_of(placed, placed_opt);
      fsdp::save_checkpoint(root + "/placed" + tag, placed_state);

      // Shard(1) etc. -> Shard(0), other initial values.
      Net plain = make_sharded(c, nullptr, 99);
      torch::optim::Adam plain_opt(plain->parameters(), torch::optim::AdamOptions(1e-2));
      fsdp::init_optimizer_state(plain_opt);
      load_state(plain, plain_opt, fsdp::load_checkpoint(root + "/placed" + tag, state_of(plain, plain_opt)));
      const auto saved = full_values(placed_state);
      const auto loaded = full_values(state_of(plain, plain_opt));
      ASSERT_EQ(saved.size(), loaded.size());
      for (const auto& [key, t] : saved) EXPECT_TRUE(t.equal(loaded.at(key))) << key;

      // And back: Shard(0) -> Shard(largest dim).
      fsdp::save_checkpoint(root + "/plain" + tag, state_of(plain, plain_opt));
      Net back = make_sharded(c, largest_dim(W), 42);
      torch::optim::Adam back_opt(back->parameters(), torch::optim::AdamOptions(1e-2));
      fsdp::init_optimizer_state(back_opt);
      load_state(back, back_opt, fsdp::load_checkpoint(root + "/plain" + tag, state_of(back, back_opt)));
      const auto again = full_values(state_of(back, back_opt));
      for (const auto& [key, t] : saved) EXPECT_TRUE(t.equal(again.at(key))) << key;

      // A safetensors export of the Shard(largest dim) model reads back into its pieces.
      fsdp::save_safetensors(fsdp::sharded_state_dict(*placed), root + "/export" + tag);
      Net exported = make_sharded(c, largest_dim(W), 11);
      fsdp::load_sharded_state_dict(
          *exported, fsdp::load_safetensors(root + "/export" + tag, fsdp::sharded_state_dict(*exported)));
      expect_close(full_params(exported), full_params(placed), 0.0, "safetensors round trip");

      // All three go on alike.
      for (int step = 2; step < 4; ++step) {
        const auto a = sharded_step(placed, placed_opt, c, step);
        const auto b = sharded_step(plain, plain_opt, c, step);
        const auto d = sharded_step(back, back_opt, c, step);
        EXPECT_NEAR(a.first, b.first, 1e-6) << "step " << step;
        EXPECT_NEAR(a.first, d.first, 1e-6) << "step " << step;
      }
      const auto after = full_params(placed);
      expect_close(after, full_params(plain), 1e-6, "after loading into Shard(0)");
      expect_close(after, full_params(back), 1e-6, "after loading back into Shard(largest dim)");
    });
  }
  // Saved at W=2 with Shard(1) pieces (and the same values with Shard(0) pieces), loaded at W=3
  // with Shard(0) and with W=3's placements: the same values every way.
  run_distributed(3, [root] {
    for (bool placed : {false, true}) {
      Config c;
      Net net = make_sharded(c, placed ? largest_dim(3) : nullptr, 5);
      torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
      fsdp::init_optimizer_state(opt);
      load_state(net, opt, fsdp::load_checkpoint(root + "/placed_w2", state_of(net, opt)));
      const auto from_w2 = full_values(state_of(net, opt));
      Net same = make_sharded(c, nullptr, 6);
      torch::optim::Adam same_opt(same->parameters(), torch::optim::AdamOptions(1e-2));
      fsdp::init_optimizer_state(same_opt);
      load_state(same, same_opt, fsdp::load_checkpoint(root + "/plain_w2", state_of(same, same_opt)));
      for (const auto& [key, t] : full_values(state_of(same, same_opt))) {
        EXPECT_TRUE(t.equal(from_w2.at(key))) << key << (placed ? " (placed)" : "");
      }
    }
  });
  remove_in_parent(root);
}
