// HSDP (fully_shard on a 2-D (replicate, shard) mesh) across real processes: parity with one
// process on the global batch, the collectives each backward issues, all-reduce skipped over
// micro-batches, gradient division (custom factor, forced sum, fp16), the all-reduce hook,
// the mesh errors, checkpoints between HSDP and FSDP, and sync_module_states.
#include "harness/multiprocess.h"
#include "test_models.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/distributed.h>
#include <fsdp/flight_recorder.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/replicate_sync.h>
#include <fsdp/state_dict.h>

#include "src/fsdp/collectives.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>

namespace fs = std::filesystem;
using fsdp::CollectiveKind;
using fsdp::ReduceOp;
using fsdp::testing::run_distributed;

namespace {

constexpr int64_t kGlobalRows = 8;  // divisible by every data-parallel size used here

fsdp::DeviceMesh make_mesh(const std::vector<int64_t>& shape) {
  if (shape.size() == 1) return fsdp::init_device_mesh("cpu", shape);
  return fsdp::init_device_mesh("cpu", shape, {"replicate", "shard"});
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s;
  for (int64_t d : shape) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

// This rank's rows of the global batch: every rank is one data-parallel rank.
std::pair<int64_t, int64_t> my_rows() {
  const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
  return {r * kGlobalRows / W, (r + 1) * kGlobalRows / W};
}

// ------------------------------------------------------------------------------ models

// Three groups (fc1, fc2, and the root owning fc3), with row counts that shard unevenly.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(uint64_t seed = 3) {
    torch::manual_seed(seed);
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 10));
    fc3 = register_module("fc3", torch::nn::Linear(10, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = fsdp::call(fc1, x).tanh();
    h = fsdp::call(fc2, h).tanh();
    return fsdp::call(fc3, h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

// fc1, fc2, root: the handles in that order.
std::vector<fsdp::FSDPModule> shard_mlp(Mlp& m, const fsdp::FullyShardOptions& opts) {
  return {fsdp::fully_shard(m->fc1, opts), fsdp::fully_shard(m->fc2, opts), fsdp::fully_shard(m, opts)};
}

std::pair<at::Tensor, at::Tensor> mlp_batch(int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  at::Tensor x = at::randn({kGlobalRows, 5}, gen);
  at::Tensor y = at::randn({kGlobalRows, 3}, gen);
  return {x, y};
}

// Mean squared error over rows [begin, end) of the step's global batch.
at::Tensor mlp_loss(Mlp& m, int64_t step, int64_t begin, int64_t end) {
  auto [x, y] = mlp_batch(step);
  return torch::nn::functional::mse_loss(fsdp::call(m, x.slice(0, begin, end)), y.slice(0, begin, end));
}

fsdp::models::Transformer make_transformer(uint64_t seed = 0) {
  torch::manual_seed(seed);
  fsdp::models::ModelArgs a;
  a.dropout_p = 0.0;
  return fsdp::models::Transformer(a);
}

// Blocks, then the root.
std::vector<fsdp::FSDPModule> shard_transformer(fsdp::models::Transformer& m, const fsdp::FullyShardOptions& opts) {
  std::vector<fsdp::FSDPModule> handles;
  for (auto& block : m->blocks()) handles.push_back(fsdp::fully_shard(block, opts));
  handles.push_back(fsdp::fully_shard(m, opts));
  return handles;
}

at::Tensor transformer_loss(fsdp::models::Transformer& m, int64_t step, int64_t begin, int64_t end) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step);
  at::Tensor toks = at::randint(0, 8, {kGlobalRows, 16}, gen).slice(0, begin, end);
  at::Tensor logits = fsdp::call(m, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
}

// ------------------------------------------------------------------------------ helpers

double global_mean(const at::Tensor& local_loss) {
  at::Tensor t = local_loss.detach().reshape({1}).clone();
  fsdp::world()->all_reduce(t, ReduceOp::kAvg)->wait();
  return t.item<double>();
}

// The whole gradient of a sharded parameter, gathered from its shards (collective).
at::Tensor full_grad_of(const at::Tensor& sharded_param) {
  auto d = fsdp::as_dtensor(sharded_param);
  return fsdp::DTensor::from_local(sharded_param.grad(), d.device_mesh(), d.placements(), d.sizes()).full_tensor();
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Every parameter's full value equals the reference module's (collective).
void expect_params_match(torch::nn::Module& model, torch::nn::Module& ref, double tol, const std::string& what) {
  auto ref_params = ref.named_parameters();
  for (const auto& item : fsdp::full_state_dict(model)) {
    const at::Tensor* r = ref_params.find(item.key());
    if (!r) continue;  // a buffer
    EXPECT_LT(max_diff(item.value(), *r), tol) << what << " " << item.key();
  }
}

// The reduce-scatter output bytes of one backward: every parameter's padded shard.
int64_t reduce_output_bytes(torch::nn::Module& model, int64_t shard_size) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) {
    const auto shape = fsdp::as_dtensor(p).sizes();
    int64_t row = 1;
    for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
    n += (shape[0] + shard_size - 1) / shard_size * row * 4;
  }
  return n;
}

fsdp::CollectiveStats stats_of(const std::shared_ptr<fsdp::ProcessGroup>& g) {
  return g ? g->stats() : fsdp::CollectiveStats{};
}

std::shared_ptr<fsdp::ProcessGroup> replicate_group_of(const fsdp::DeviceMesh& mesh) {
  return mesh.ndim() == 2 ? mesh.get_group(0) : nullptr;
}
std::shared_ptr<fsdp::ProcessGroup> shard_group_of(const fsdp::DeviceMesh& mesh) {
  return mesh.get_group(mesh.ndim() - 1);
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

// Meshes of W ranks the parity and count tests run on.
std::vector<std::vector<int64_t>> meshes_of(int W) {
  if (W == 4) return {{2, 2}, {1, 4}, {4, 1}};
  return {{2, 1}, {1, 2}};
}

}  // namespace

// ------------------------------------------------------------------------------ division rule

TEST(Hsdp, GradientDivisionFollowsEveryRowOfFsdp2sRule) {
  using fsdp::detail::gradient_division;
  const auto none = std::nullopt;
  // fp32/bf16, not forced, no factor: SUM at N = 1, AVG/AVG otherwise.
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto d = gradient_division(dtype, 1, 1, none, false);
    EXPECT_EQ(d.reduce_scatter_op, ReduceOp::kSum);
    EXPECT_EQ(d.all_reduce_op, ReduceOp::kSum);
    EXPECT_TRUE(d.is_identity());
    for (auto sizes : std::vector<std::pair<int64_t, int64_t>>{{2, 1}, {1, 2}, {2, 2}, {4, 1}}) {
      d = gradient_division(dtype, sizes.first, sizes.second, none, false);
      EXPECT_EQ(d.reduce_scatter_op, ReduceOp::kAvg);
      EXPECT_EQ(d.all_reduce_op, ReduceOp::kAvg);
      EXPECT_TRUE(d.is_identity());
    }
  }
  // A factor: AVG if F == S, else PREMUL_SUM(1/F) (a pre-multiply and SUM); SUM all-reduce.
  auto d = gradient_division(at::kFloat, 4, 2, 4.0, false);
  EXPECT_EQ(d.reduce_scatter_op, ReduceOp::kAvg);
  EXPECT_EQ(d.premul, 1.0);
  EXPECT_EQ(d.all_reduce_op, ReduceOp::kSum);
  EXPECT_EQ(d.pre_divide, 1.0);
  EXPECT_EQ(d.post_divide, 1.0);
  d = gradient_division(at::kBFloat16, 4, 2, 8.0, false);
  EXPECT_EQ(d.reduce_scatter_op, ReduceOp::kSum);
  EXPECT_EQ(d.premul, 1.0 / 8.0);
  EXPECT_EQ(d.all_reduce_op, ReduceOp::kSum);
  EXPECT_EQ(d.post_divide, 1.0);
  // Forced sum: SUM/SUM, the whole division after (F' = F, or N without a factor).
  d = gradient_division(at::kFloat, 2, 2, none, true);
  EXPECT_EQ(d.reduce_scatter_op, ReduceOp::kSum);
  EXPECT_EQ(d.all_reduce_op, ReduceOp::kSum);
  EXPECT_EQ(d.pre_divide, 1.0);
  EXPECT_EQ(d.premul, 1.0);
  EXPECT_EQ(d.post_divide, 4.0);
  d = gradient_division(at::kFloat, 2, 2, 6.0, true);
  EXPECT_EQ(d.post_divide, 6.0);
  EXPECT_EQ(d.pre_divide, 1.0);
  // fp16 (overflow risk): pre p, post F'/p, SUM/SUM, forced or not, with or without a factor.
  const std::vector<std::array<double, 3>> rows = {{2, 2, 1},  {4, 2, 2},   {8, 4, 2},
                                                   {16, 4, 4}, {3, 2, 1.5}, {6, 4, 1.5}};
  for (const auto& row : rows) {
    const double f = row[0];
    for (bool force : {false, true}) {
      d = gradient_division(at::kHalf, 1, 1, f, force);  // F given
      EXPECT_EQ(d.reduce_scatter_op, ReduceOp::kSum);
      EXPECT_EQ(d.all_reduce_op, ReduceOp::kSum);
      EXPECT_EQ(d.pre_divide, row[1]) << "F' " << f;
      EXPECT_EQ(d.post_divide, row[2]) << "F' " << f;
      EXPECT_EQ(d.premul, 1.0);
    }
    if (f == 3 || f == 6) {  // F' = N = S * R without a factor
      d = gradient_division(at::kHalf, static_cast<int64_t>(f) / 3, 3, none, false);
    } else {
      d = gradient_division(at::kHalf, static_cast<int64_t>(f) / 2, 2, none, false);
    }
    EXPECT_EQ(d.pre_divide, row[1]) << "N " << f;
    EXPECT_EQ(d.post_divide, row[2]) << "N " << f;
  }
}

// ------------------------------------------------------------------------------ parity

// SGD with momentum on the MLP and Adam on the Transformer, 3 steps on every mesh of W ranks:
// the mean loss and the full parameters equal one process training on the global batch.
TEST(Hsdp, TrainsLikeOneProcessOnTheGlobalBatch) {
  for (int world : {4, 2}) {
    run_distributed(world, [] {
      const auto [begin, end] = my_rows();
      for (const auto& shape : meshes_of(fsdp::get_world_size())) {
        const std::string what = "mesh " + shape_str(shape);
        auto mesh = make_mesh(shape);
        auto opts = fsdp::FullyShardOptions().mesh(mesh);
        {
          Mlp model, ref;
          shard_mlp(model, opts);
          torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
          for (int64_t step = 0; step < 3; ++step) {
            opt.zero_grad();
            ref_opt.zero_grad();
            at::Tensor loss = mlp_loss(model, step, begin, end);
            loss.backward();
            at::Tensor ref_loss = mlp_loss(ref, step, 0, kGlobalRows);
            ref_loss.backward();
            EXPECT_NEAR(global_mean(loss), ref_loss.item<double>(), 1e-5) << what << " step " << step;
            opt.step();
            ref_opt.step();
          }
          expect_params_match(*model, *ref, 1e-5, what + " mlp");
        }
        {
          auto model = make_transformer(), ref = make_transformer();
          shard_transformer(model, opts);
          auto shard_group = shard_group_of(mesh);
          shard_group->reset_stats();
          torch::optim::Adam opt(model->parameters(), 1e-2), ref_opt(ref->parameters(), 1e-2);
          for (int64_t step = 0; step < 3; ++step) {
            opt.zero_grad();
            ref_opt.zero_grad();
            at::Tensor loss = transformer_loss(model, step, begin, end);
            loss.backward();
            at::Tensor ref_loss = transformer_loss(ref, step, 0, kGlobalRows);
            ref_loss.backward();
            EXPECT_NEAR(global_mean(loss), ref_loss.item<double>(), 1e-5) << what << " step " << step;
            opt.step();
            ref_opt.step();
          }
          if (shape.back() == 1) {  // a shard group of one rank: nothing is gathered or scattered
            EXPECT_EQ(shard_group->stats().total_calls(), 0) << what;
          }
          expect_params_match(*model, *ref, 1e-5, what + " transformer");
        }
      }
    });
  }
}

// ------------------------------------------------------------------------------ collectives

// One all-reduce per reduce output on a 2-D mesh (also with a replicate or shard group of one),
// none on a 1-D mesh; the all-reduce moves what the reduce-scatter produced.
TEST(Hsdp, OneAllReducePerReduceScatterOn2DAndNoneOn1D) {
  run_distributed(4, [] {
    std::vector<std::vector<int64_t>> shapes = meshes_of(4);
    shapes.push_back({4});
    for (const auto& shape : shapes) {
      const std::string what = "mesh " + shape_str(shape);
      auto mesh = make_mesh(shape);
      auto shard_group = shard_group_of(mesh);
      auto replicate_group = replicate_group_of(mesh);
      auto model = make_transformer();
      const int64_t groups =
          static_cast<int64_t>(shard_transformer(model, fsdp::FullyShardOptions().mesh(mesh)).size());
      for (int64_t step = 0; step < 2; ++step) {
        shard_group->reset_stats();
        if (replicate_group) replicate_group->reset_stats();
        at::Tensor loss = transformer_loss(model, step, my_rows().first, my_rows().second);
        loss.backward();
        const auto rs = shard_group->stats();
        const auto ar = stats_of(replicate_group);
        const int64_t S = shape.back();
        EXPECT_EQ(rs[CollectiveKind::kReduceScatter].calls, S > 1 ? groups : 0) << what;
        EXPECT_EQ(rs[CollectiveKind::kAllReduce].calls, 0) << what << ": nothing is all-reduced over the shard group";
        if (S == 1) {
          EXPECT_EQ(rs[CollectiveKind::kAllGather].calls, 0) << what;
        }
        if (shape.size() == 1) {
          EXPECT_EQ(ar.total_calls(), 0) << what;
          continue;
        }
        EXPECT_EQ(ar[CollectiveKind::kAllReduce].calls, groups) << what;
        EXPECT_EQ(ar.total_calls(), groups) << what;
        if (S > 1) {
          EXPECT_EQ(ar[CollectiveKind::kAllReduce].calls, rs[CollectiveKind::kReduceScatter].calls) << what;
        }
        if (shape == std::vector<int64_t>{2, 2}) {
          // With 2 ranks per group, each receives exactly one output's worth in either collective.
          const int64_t out_bytes = reduce_output_bytes(*model, 2);
          EXPECT_EQ(rs[CollectiveKind::kReduceScatter].bytes_received, out_bytes);
          EXPECT_EQ(ar[CollectiveKind::kAllReduce].bytes_received, out_bytes);
        }
        model->zero_grad();
      }
    }
  });
}

namespace {

// The collectives this rank issued on `groups` from record `from` on, in issue order, as
// "<op>@<index of its group in groups>".
std::vector<std::string> issued_since(int64_t from, const std::vector<std::string>& groups) {
  int64_t total = 0;
  const auto records = fsdp::FlightRecorder::global().snapshot(&total);
  std::vector<std::string> out;
  for (const auto& rec : records) {
    if (rec.id < from) continue;
    const auto g = std::find(groups.begin(), groups.end(), rec.group);
    if (g != groups.end()) out.push_back(rec.op + "@" + std::to_string(g - groups.begin()));
  }
  return out;
}

int64_t records_so_far() {
  int64_t total = 0;
  fsdp::FlightRecorder::global().snapshot(&total);
  return total;
}

}  // namespace

// FSDP2's program order: each all-reduce over the replicate group is issued right after its
// reduce-scatter, so every rank interleaves the two groups' collectives identically (NCCL can
// hang otherwise). Checked on the issue order the flight recorder saw, and across ranks.
TEST(Hsdp, EachAllReduceIsIssuedRightAfterItsReduceScatter) {
  run_distributed(4, [] {
    auto mesh = make_mesh({2, 2});
    const std::vector<std::string> groups = {shard_group_of(mesh)->name(), replicate_group_of(mesh)->name()};
    // Four blocks: backward prefetches an all-gather between one block's reduce-scatter and the next.
    torch::manual_seed(0);
    fsdp::models::ModelArgs args;
    args.dropout_p = 0.0;
    args.n_layers = 4;
    fsdp::models::Transformer model(args);
    shard_transformer(model, fsdp::FullyShardOptions().mesh(mesh));
    for (int64_t step = 0; step < 3; ++step) {
      const int64_t from = records_so_far();
      transformer_loss(model, step, my_rows().first, my_rows().second).backward();
      const std::vector<std::string> order = issued_since(from, groups);
      std::string joined;
      for (const auto& op : order) joined += op + " ";
      int64_t reduce_scatters = 0;
      for (size_t i = 0; i < order.size(); ++i) {
        if (order[i] != "reduce_scatter@0") continue;
        ++reduce_scatters;
        ASSERT_LT(i + 1, order.size()) << joined;
        EXPECT_EQ(order[i + 1], "all_reduce@1") << "collective " << i + 1 << " of step " << step << ": " << joined;
      }
      EXPECT_EQ(std::count(order.begin(), order.end(), "all_reduce@1"), reduce_scatters) << joined;
      EXPECT_GT(reduce_scatters, 1) << joined;
      // The same sequence on every rank (each rank's shard and replicate groups have other names).
      const auto digest = static_cast<double>(std::hash<std::string>{}(joined) % (int64_t{1} << 40));
      at::Tensor mine = at::full({1}, digest, at::kDouble);
      at::Tensor lowest = mine.clone(), highest = mine.clone();
      fsdp::world()->all_reduce(lowest, ReduceOp::kMin)->wait();
      fsdp::world()->all_reduce(highest, ReduceOp::kMax)->wait();
      EXPECT_EQ(lowest.item<double>(), highest.item<double>()) << "step " << step << ": " << joined;
      model->zero_grad();
    }
  });
}

// Three micro-batches at 2x2: with set_requires_all_reduce(false) on the first two every
// micro-batch reduce-scatters, only the last all-reduces, no gradient appears before it, and
// the gradients equal the single-process sum over the three. set_requires_gradient_sync(false)
// skips both collectives and gives the same gradients.
TEST(Hsdp, SkippingTheAllReduceOverMicroBatches) {
  run_distributed(4, [] {
    auto mesh = make_mesh({2, 2});
    auto shard_group = shard_group_of(mesh);
    auto replicate_group = replicate_group_of(mesh);
    const auto [begin, end] = my_rows();
    for (bool sync_off : {false, true}) {
      const std::string what = sync_off ? "set_requires_gradient_sync(false)" : "set_requires_all_reduce(false)";
      Mlp model, ref;
      auto handles = shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh));
      fsdp::FSDPModule root = handles.back();
      const int64_t groups = static_cast<int64_t>(handles.size());
      for (int64_t mb = 0; mb < 3; ++mb) {
        const bool last = mb == 2;
        if (sync_off) root.set_requires_gradient_sync(last);
        else root.set_requires_all_reduce(last);
        shard_group->reset_stats();
        replicate_group->reset_stats();
        mlp_loss(model, mb, begin, end).backward();
        mlp_loss(ref, mb, 0, kGlobalRows).backward();
        const auto rs = shard_group->stats();
        const auto ar = replicate_group->stats();
        EXPECT_EQ(rs[CollectiveKind::kReduceScatter].calls, sync_off && !last ? 0 : groups) << what << " mb " << mb;
        EXPECT_EQ(ar[CollectiveKind::kAllReduce].calls, last ? groups : 0) << what << " mb " << mb;
        if (!last) {
          for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined()) << what << " mb " << mb;
        } else if (!sync_off) {
          const int64_t out_bytes = reduce_output_bytes(*model, 2);
          EXPECT_EQ(ar[CollectiveKind::kAllReduce].bytes_received, out_bytes) << what;
          EXPECT_EQ(rs[CollectiveKind::kReduceScatter].bytes_received, out_bytes) << what;
        }
      }
      auto ref_params = ref->named_parameters();
      for (const auto& item : model->named_parameters()) {
        ASSERT_TRUE(item.value().grad().defined()) << what << " " << item.key();
        EXPECT_LT(max_diff(full_grad_of(item.value()), ref_params[item.key()].grad()), 1e-6)
            << what << " " << item.key();
      }
    }
  });
}

// ------------------------------------------------------------------------------ division

namespace {

// The sum over data-parallel ranks of the per-rank gradients (each rank's loss is its mean).
std::map<std::string, at::Tensor> summed_reference_grads(int64_t step) {
  Mlp ref;
  const int W = fsdp::get_world_size();
  at::Tensor total = at::zeros({});
  for (int r = 0; r < W; ++r) total = total + mlp_loss(ref, step, r * kGlobalRows / W, (r + 1) * kGlobalRows / W);
  total.backward();
  std::map<std::string, at::Tensor> out;
  for (const auto& item : ref->named_parameters()) out[item.key()] = item.value().grad().clone();
  return out;
}

bool owned_by_root(const std::string& fqn) { return fqn.rfind("fc3.", 0) == 0; }

// Sharded grads: the root's (fc3) equal Σ g / root_divisor, the others Σ g / other_divisor.
void expect_divided_grads(Mlp& model, double root_divisor, double other_divisor, double tol, const std::string& what) {
  const auto sum = summed_reference_grads(0);
  for (const auto& item : model->named_parameters()) {
    const double divisor = owned_by_root(item.key()) ? root_divisor : other_divisor;
    ASSERT_TRUE(item.value().grad().defined()) << what << " " << item.key();
    const at::Tensor expected = sum.at(item.key()) / divisor;
    EXPECT_LT(max_diff(full_grad_of(item.value()), expected), tol * (1 + expected.abs().max().item<double>()))
        << what << " " << item.key();
  }
}

}  // namespace

// set_gradient_divide_factor(f) on the root only, f in {S, W, 2W}: the root's gradients are the
// sum over ranks divided by f (AVG when f == S, the emulated PREMUL_SUM otherwise), the
// submodules' stay means.
TEST(Hsdp, GradientDivideFactorAppliesToItsModuleOnly) {
  run_distributed(4, [] {
    const int W = fsdp::get_world_size();
    const auto [begin, end] = my_rows();
    for (const auto& shape : std::vector<std::vector<int64_t>>{{4}, {2, 2}}) {
      auto mesh = make_mesh(shape);
      for (double f : {static_cast<double>(shape.back()), 1.0 * W, 2.0 * W}) {
        const std::string what = "mesh " + shape_str(shape) + " factor " + std::to_string(f);
        Mlp model;
        auto handles = shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh));
        handles.back().set_gradient_divide_factor(f);
        mlp_loss(model, 0, begin, end).backward();
        expect_divided_grads(model, f, W, 1e-6, what);
      }
    }
    Mlp model;
    auto handles = shard_mlp(model, fsdp::FullyShardOptions().mesh(make_mesh({2, 2})));
    expect_error_containing([&] { handles.back().set_gradient_divide_factor(0.0); }, "positive and finite");
  });
}

// Forced SUM collectives divide afterwards (same means); with a factor, Σ / f. An fp16 reduce
// dtype divides before and after its SUMs and still gives the means (within fp16's precision).
TEST(Hsdp, ForcedSumAndFp16ReductionGiveTheSameMeans) {
  run_distributed(4, [] {
    const int W = fsdp::get_world_size();
    const auto [begin, end] = my_rows();
    for (const auto& shape : std::vector<std::vector<int64_t>>{{4}, {2, 2}}) {
      auto mesh = make_mesh(shape);
      const std::string what = "mesh " + shape_str(shape);
      {
        Mlp model;
        auto handles = shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh));
        handles.back().set_force_sum_reduction_for_comms(true);
        mlp_loss(model, 0, begin, end).backward();
        expect_divided_grads(model, W, W, 1e-6, what + " forced sum");
      }
      {
        Mlp model;
        auto handles = shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh));
        handles.back().set_force_sum_reduction_for_comms(true);
        handles.back().set_gradient_divide_factor(3.0);
        mlp_loss(model, 0, begin, end).backward();
        expect_divided_grads(model, 3.0, W, 1e-6, what + " forced sum, factor 3");
      }
      {
        Mlp model;
        shard_mlp(model,
                  fsdp::FullyShardOptions().mesh(mesh).mp_policy(fsdp::MixedPrecisionPolicy().reduce_dtype(at::kHalf)));
        mlp_loss(model, 0, begin, end).backward();
        expect_divided_grads(model, W, W, 2e-3, what + " fp16 reduce");
      }
    }
  });
}

// ------------------------------------------------------------------------------ all-reduce hook

// The hook sees each reduce output once per backward (padded shard size), after the native
// all-reduce under HSDP; what it leaves is what the gradients are made of. On a 1-D mesh over
// one replica's ranks, a hook that all-reduces over the replicas gives HSDP's gradients.
TEST(Hsdp, AllReduceHookSeesEveryReduceOutputOnce) {
  run_distributed(4, [] {
    const int W = fsdp::get_world_size();
    const auto [begin, end] = my_rows();
    auto mesh = make_mesh({2, 2});
    {
      Mlp model;
      auto handles = shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh));
      std::vector<int> calls(handles.size(), 0);
      std::vector<int64_t> numel(handles.size(), 0);
      for (size_t i = 0; i < handles.size(); ++i) {
        handles[i].set_all_reduce_hook([&calls, &numel, i](at::Tensor& out) {
          ++calls[i];
          numel[i] = out.numel();
          if (i + 1 == calls.size()) out.mul_(2.0);  // the root's: doubled
        });
      }
      for (int64_t step = 0; step < 2; ++step) {
        model->zero_grad();
        mlp_loss(model, 0, begin, end).backward();
        for (size_t i = 0; i < calls.size(); ++i) EXPECT_EQ(calls[i], step + 1) << "hook " << i;
      }
      // fc1: weight 7x5 and bias 7, each ceil(7/2) = 4 rows per shard.
      EXPECT_EQ(numel[0], 4 * 5 + 4);
      expect_divided_grads(model, W / 2.0, W, 1e-6, "hook doubling the root's");
    }
    {
      auto replicas = mesh.get_group("replicate");
      Mlp model;
      auto handles = shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh["shard"]));
      for (auto& h : handles) {
        h.set_all_reduce_hook([replicas](at::Tensor& out) { replicas->all_reduce(out, ReduceOp::kAvg)->wait(); });
      }
      replicas->reset_stats();
      mlp_loss(model, 0, begin, end).backward();
      EXPECT_EQ(replicas->stats()[CollectiveKind::kAllReduce].calls, static_cast<int64_t>(handles.size()));
      expect_divided_grads(model, W, W, 1e-6, "1-D with the hook all-reducing over replicas");
    }
  });
}

// ------------------------------------------------------------------------------ errors

TEST(Hsdp, MeshesFullyShardRefusesSayWhatToPass) {
  run_distributed(2, [] {
    Mlp a, b;
    auto cube = fsdp::init_device_mesh("cpu", {1, 1, 2}, {"a", "b", "c"});
    expect_error_containing([&] { fsdp::fully_shard(a, fsdp::FullyShardOptions().mesh(cube)); }, "1-D or 2-D");
    auto unnamed = fsdp::init_device_mesh("cpu", {1, 2});
    expect_error_containing([&] { fsdp::fully_shard(b, fsdp::FullyShardOptions().mesh(unnamed)); }, "mesh_dim_names");
    expect_error_containing([&] { fsdp::sync_module_states(*a, fsdp::init_device_mesh("cpu", {2})); }, "2-D HSDP mesh");
  });
}

// ------------------------------------------------------------------------------ checkpoints

namespace {

// Model + Adam on a mesh of the given shape; the global batch of a step is the same everywhere.
struct Trainer {
  fsdp::models::Transformer model{nullptr};
  std::unique_ptr<torch::optim::Adam> opt;
  explicit Trainer(const std::vector<int64_t>& shape, uint64_t seed) {
    model = make_transformer(seed);
    shard_transformer(model, fsdp::FullyShardOptions().mesh(make_mesh(shape)));
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  }
  void step(int64_t s) {
    opt->zero_grad();
    transformer_loss(model, s, my_rows().first, my_rows().second).backward();
    opt->step();
  }
  fsdp::ShardedStateDict state() {
    fsdp::ShardedStateDict sd;
    for (const auto& item : fsdp::sharded_state_dict(*model)) sd.insert("model." + item.key(), item.value());
    for (const auto& item : fsdp::sharded_optimizer_state_dict(*model, *opt))
      sd.insert("optim." + item.key(), item.value());
    return sd;
  }
  void load(const std::string& dir) {
    fsdp::init_optimizer_state(*opt);
    fsdp::ShardedStateDict model_part, optim_part;
    for (const auto& item : fsdp::load_checkpoint(dir, state())) {
      if (item.key().rfind("model.", 0) == 0) model_part.insert(item.key().substr(6), item.value());
      else optim_part.insert(item.key().substr(6), item.value());
    }
    fsdp::load_sharded_state_dict(*model, model_part);
    fsdp::load_sharded_optimizer_state_dict(*model, *opt, optim_part);
  }
  // The full parameters after one more step (collective), on rank 0.
  void save_params_after_step(int64_t s, const std::string& path) {
    step(s);
    auto full = fsdp::full_state_dict(*model, fsdp::FullStateDictOptions().rank0_only(true));
    if (fsdp::get_rank() == 0) fsdp::save_pytorch_state_dict(full, path);
  }
};

void expect_same_file_contents(const std::string& a, const std::string& b, const std::string& what) {
  const auto x = fsdp::load_pytorch_state_dict(a), y = fsdp::load_pytorch_state_dict(b);
  ASSERT_EQ(x.size(), y.size()) << what;
  for (const auto& item : x) EXPECT_LT(max_diff(item.value(), y[item.key()]), 1e-5) << what << " " << item.key();
}

}  // namespace

// Model and Adam state saved under HSDP 2x2 load under FSDP at W=4 and W=1, and checkpoints of
// those load under HSDP 2x2: one more step then gives the same parameters everywhere. Only the
// first replica writes the sharded pieces.
TEST(Hsdp, CheckpointsMoveBetweenHsdpAndFsdp) {
  const std::string root = fsdp::testing::shared_temp_path("hsdp_ckpt");
  if (!fsdp::testing::is_child()) fs::remove_all(root);
  const std::vector<int64_t> hsdp{2, 2}, fsdp4{4}, fsdp1{1};
  // Reference and the HSDP checkpoint after 2 steps.
  run_distributed(4, [&] {
    Trainer t(hsdp, 0);
    t.step(0);
    t.step(1);
    fsdp::save_checkpoint(root + "/hsdp", t.state());
    t.save_params_after_step(2, root + "/reference.pt");
  });
  const bool parent = !fsdp::testing::is_child();
  if (parent) {
    for (const char* f : {"rank_2.data", "rank_3.data"}) {  // the second replica's ranks
      EXPECT_EQ(fs::file_size(root + "/hsdp/" + f), 0u) << f;
    }
    EXPECT_GT(fs::file_size(root + "/hsdp/rank_1.data"), 0u);
  }
  // HSDP -> FSDP at 4 and 1; each saves what it loaded for the way back.
  for (const auto* shape : {&fsdp4, &fsdp1}) {
    const std::string name = "fsdp" + shape_str(*shape);
    run_distributed(static_cast<int>((*shape)[0]), [&, shape, name] {
      Trainer t(*shape, 77);
      t.load(root + "/hsdp");
      fsdp::save_checkpoint(root + "/" + name, t.state());
      t.save_params_after_step(2, root + "/" + name + "_after.pt");
    });
    if (parent) expect_same_file_contents(root + "/reference.pt", root + "/" + name + "_after.pt", "HSDP -> " + name);
  }
  // FSDP -> HSDP.
  for (const char* name : {"fsdp4", "fsdp1"}) {
    run_distributed(4, [&, name] {
      Trainer t(hsdp, 55);
      t.load(root + "/" + name);
      t.save_params_after_step(2, root + "/hsdp_from_" + name + ".pt");
    });
    if (parent) {
      expect_same_file_contents(root + "/reference.pt", root + "/hsdp_from_" + std::string(name) + ".pt",
                                std::string(name) + " -> HSDP");
    }
  }
  if (parent) fs::remove_all(root);
}

// ------------------------------------------------------------------------------ sync_module_states

// Replicas built from different seeds hold replica 0's parameters and buffers after the sync,
// whether it runs on the whole tensors (before fully_shard) or on the shards (after).
TEST(Hsdp, SyncModuleStatesMakesReplicasIdentical) {
  run_distributed(4, [] {
    auto mesh = make_mesh({2, 2});
    const uint64_t seed = 10 + static_cast<uint64_t>(mesh.get_local_rank(0));
    fsdp::testing::WithBuffer expected(10);
    auto expected_params = expected->named_parameters();
    for (bool after_fully_shard : {true, false}) {
      const std::string what = after_fully_shard ? "after fully_shard" : "before fully_shard";
      fsdp::testing::WithBuffer model(seed);
      auto shard = [&] {
        for (auto& block : model->net->blocks()) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh));
        fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
      };
      if (after_fully_shard) shard();
      fsdp::sync_module_states(*model, mesh);
      if (!after_fully_shard) shard();
      for (const auto& item : fsdp::full_state_dict(*model)) {
        const at::Tensor* e = expected_params.find(item.key());
        const at::Tensor want = e ? *e : expected->scale;
        EXPECT_TRUE(item.value().equal(want)) << what << " " << item.key();
      }
    }
  });
}
