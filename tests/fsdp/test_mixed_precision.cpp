// MixedPrecisionPolicy across real processes: parity with single-process references that apply
// the same casts, the bytes the collectives move, no-sync accumulation in the reduce dtype, the
// casts at module boundaries, per-module policies, checkpoints across policies, and the errors.
#include "harness/multiprocess.h"
#include "test_models.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>
#include <fsdp/state_dict.h>

#include "src/fsdp/collectives.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

using fsdp::CollectiveKind;
using fsdp::MixedPrecisionPolicy;
using fsdp::testing::run_distributed;

namespace {

MixedPrecisionPolicy bf16(std::optional<at::ScalarType> reduce = at::kFloat) {
  return MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(reduce);
}

// fc1 and fc2 are FSDP modules of their own; fc3 belongs to the root. Dims 5 -> 7 -> 9 -> 3 do
// not divide 2, 3 or 4, so shards are uneven and padded.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    torch::manual_seed(7);
    fc1 = register_module("fc1", torch::nn::Linear(5, 7));
    fc2 = register_module("fc2", torch::nn::Linear(7, 9));
    fc3 = register_module("fc3", torch::nn::Linear(9, 3));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = fsdp::call(fc1, x).relu();
    h = fsdp::call(fc2, h).relu();
    return fsdp::call(fc3, h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

void shard_mlp(Mlp& m, const fsdp::FullyShardOptions& opts) {
  fsdp::fully_shard(m->fc1, opts);
  fsdp::fully_shard(m->fc2, opts);
  fsdp::fully_shard(m, opts);
}

fsdp::models::Transformer make_transformer() {
  torch::manual_seed(0);
  fsdp::models::ModelArgs a;
  a.dropout_p = 0.0;
  return fsdp::models::Transformer(a);
}

void shard_transformer(fsdp::models::Transformer& m, const fsdp::FullyShardOptions& opts) {
  for (auto& block : m->blocks()) fsdp::fully_shard(block, opts);
  fsdp::fully_shard(m, opts);
}

// Rank r's batch of step `step` (every rank can make every rank's batch).
at::Tensor mlp_input(int64_t step, int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step + 1000 * rank);
  return at::randn({4, 5}, gen);
}
at::Tensor transformer_tokens(int64_t step, int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step + 1000 * rank);
  return at::randint(0, 8, {2, 16}, gen);
}

// The loss in fp32, whatever dtype the model returns. The input is cast to the dtype fc1
// computes in, as a reference model in that dtype needs (under FSDP it already is that dtype).
at::Tensor mlp_loss(Mlp& m, const at::Tensor& x) {
  return fsdp::call(m, x.to(m->fc1->weight.scalar_type())).to(at::kFloat).pow(2).mean();
}
at::Tensor transformer_loss(fsdp::models::Transformer& m, const at::Tensor& toks) {
  at::Tensor logits = fsdp::call(m, toks).to(at::kFloat);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
}

// The whole gradient of a sharded parameter, gathered from every rank's shard (collective).
at::Tensor full_grad_of(const at::Tensor& sharded_param) {
  auto d = fsdp::as_dtensor(sharded_param);
  return fsdp::DTensor::from_local(sharded_param.grad(), d.device_mesh(), d.placements(), d.sizes()).full_tensor();
}
at::Tensor full_param_of(const at::Tensor& sharded_param) { return fsdp::as_dtensor(sharded_param).full_tensor(); }

// What FSDP with param_dtype `compute` and reduce dtype `reduce` must produce, computed in this
// one process: every rank's batch goes through a `compute` copy of the fp32 master weights, each
// batch's gradient is cast to `reduce`, and the mean over the ranks is cast back to fp32.
template <typename Model, typename LossFn>
std::map<std::string, at::Tensor> reference_grads(Model& master, Model& scratch, at::ScalarType compute,
                                                  at::ScalarType reduce, int64_t world, const LossFn& loss_of_rank) {
  std::map<std::string, at::Tensor> sum;
  for (int64_t r = 0; r < world; ++r) {
    {
      at::NoGradGuard no_grad;
      scratch->to(at::kFloat);
      auto src = master->named_parameters();
      for (auto& item : scratch->named_parameters()) item.value().copy_(src[item.key()]);
      scratch->to(compute);
    }
    scratch->zero_grad();
    loss_of_rank(scratch, r).backward();
    for (const auto& item : scratch->named_parameters()) {
      at::Tensor g = item.value().grad().to(reduce, /*non_blocking=*/false, /*copy=*/true);  // zero_grad reuses it
      sum[item.key()] = sum.count(item.key()) ? sum[item.key()] + g : g;
    }
  }
  for (auto& kv : sum) kv.second = (kv.second / static_cast<double>(world)).to(at::kFloat);
  return sum;
}

// Largest |a - b| relative to the largest |b| (plus a floor, for gradients that are ~0).
double relative_error(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / (b.abs().max().item<double>() + 1e-6);
}

// Steps FSDP (`model`, sharded with `policy`) and an unsharded fp32 master through the same SGD
// updates (not Adam: it turns rounding noise on a ~0 gradient into a full step). The first
// step's gathered gradients must match the reference within `tolerance`; later ones within
// bf16's: the master weights then differ from FSDP's in their last fp32 bits, and a bf16 cast
// may round an element to the neighbouring value.
template <typename Model, typename LossFn>
void expect_matches_reference(Model& model, Model& master, Model& scratch, const MixedPrecisionPolicy& policy,
                              const LossFn& loss_of_rank, double tolerance) {
  const int64_t W = fsdp::get_world_size(), rank = fsdp::get_rank();
  const at::ScalarType compute = policy.param_dtype().value_or(at::kFloat);
  const at::ScalarType reduce = policy.reduce_dtype().value_or(compute);
  torch::optim::SGD opt(model->parameters(), 0.1);
  torch::optim::SGD master_opt(master->parameters(), 0.1);
  for (int64_t step = 0; step < 3; ++step) {
    const double step_tolerance = step == 0 ? tolerance : std::max(tolerance, 2e-2);
    opt.zero_grad();
    loss_of_rank(model, rank).backward();
    auto expected = reference_grads(master, scratch, compute, reduce, W, loss_of_rank);
    for (const auto& item : model->named_parameters()) {
      ASSERT_EQ(item.value().scalar_type(), at::kFloat) << "the sharded parameters stay fp32";
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      ASSERT_EQ(item.value().grad().scalar_type(), at::kFloat) << item.key();
      EXPECT_LT(relative_error(full_grad_of(item.value()), expected[item.key()]), step_tolerance)
          << item.key() << " step " << step;
    }
    opt.step();
    for (auto& item : master->named_parameters()) item.value().mutable_grad() = expected[item.key()];
    master_opt.step();
  }
}

}  // namespace

TEST(MixedPrecision, GradientDivisionFollowsPyTorchForFp16) {
  using fsdp::detail::gradient_division;
  EXPECT_EQ(gradient_division(at::kFloat, 8, 1, std::nullopt, false).reduce_scatter_op, fsdp::ReduceOp::kAvg);
  EXPECT_EQ(gradient_division(at::kBFloat16, 8, 1, std::nullopt, false).reduce_scatter_op, fsdp::ReduceOp::kAvg);
  const std::vector<std::array<double, 3>> fp16 = {{2, 2, 1},  {4, 2, 2},   {8, 4, 2},
                                                   {16, 4, 4}, {3, 2, 1.5}, {6, 4, 1.5}};
  for (const auto& c : fp16) {
    const auto d = gradient_division(at::kHalf, static_cast<int64_t>(c[0]), 1, std::nullopt, false);
    EXPECT_EQ(d.reduce_scatter_op, fsdp::ReduceOp::kSum);
    EXPECT_EQ(d.pre_divide, c[1]) << "world " << c[0];
    EXPECT_EQ(d.post_divide, c[2]) << "world " << c[0];
  }
}

// param_dtype equal to the parameters' dtype is no policy at all; bf16 compute with fp32 or bf16
// reduction matches the single-process reference that applies the same casts.
TEST(MixedPrecision, MatchesSingleProcessReferences) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      auto mlp_loss_of = [](Mlp& m, int64_t r) { return mlp_loss(m, mlp_input(0, r)); };

      {  // An fp32 policy trains bitwise like no policy.
        Mlp plain, same;
        shard_mlp(plain, fsdp::FullyShardOptions().mesh(mesh));
        shard_mlp(same, fsdp::FullyShardOptions().mesh(mesh).mp_policy(
                            MixedPrecisionPolicy().param_dtype(at::kFloat).reduce_dtype(at::kFloat)));
        torch::optim::Adam a(plain->parameters(), 1e-2), b(same->parameters(), 1e-2);
        for (int64_t step = 0; step < 3; ++step) {
          a.zero_grad();
          b.zero_grad();
          mlp_loss(plain, mlp_input(step, fsdp::get_rank())).backward();
          mlp_loss(same, mlp_input(step, fsdp::get_rank())).backward();
          a.step();
          b.step();
        }
        auto expected = plain->named_parameters();
        for (const auto& item : same->named_parameters()) {
          EXPECT_TRUE(item.value().equal(expected[item.key()])) << item.key() << " differs from no policy";
        }
      }
      // bf16 compute, fp32 reduce (bf16 casts are exact on both sides; only the order of the
      // fp32 sums differs) and bf16 reduce (the ring sums in bf16: bf16's unit roundoff, 2^-8).
      for (auto reduce : {std::optional<at::ScalarType>(at::kFloat), std::optional<at::ScalarType>()}) {
        Mlp model, master, scratch;
        shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh).mp_policy(bf16(reduce)));
        expect_matches_reference(model, master, scratch, bf16(reduce), mlp_loss_of, reduce ? 1e-4 : 2e-2);
      }
      {  // The Transformer, with a post-forward reshard to half the world where there is one.
        auto model = make_transformer(), master = make_transformer(), scratch = make_transformer();
        fsdp::ReshardAfterForward raf = W == 4 ? fsdp::ReshardAfterForward(2) : fsdp::ReshardAfterForward();
        shard_transformer(model, fsdp::FullyShardOptions().mesh(mesh).mp_policy(bf16()).reshard_after_forward(raf));
        auto loss_of = [](fsdp::models::Transformer& m, int64_t r) {
          return transformer_loss(m, transformer_tokens(0, r));
        };
        expect_matches_reference(model, master, scratch, bf16(), loss_of, 1e-4);
      }
    });
  }
}

// fp16 reduction (pre- and post-divided, as PyTorch does against overflow) of bf16 gradients.
TEST(MixedPrecision, Fp16ReductionIsDividedBeforeAndAfter) {
  run_distributed(3, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {3});
    Mlp model, master, scratch;
    auto policy = bf16(at::kHalf);
    shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh).mp_policy(policy));
    auto loss_of = [](Mlp& m, int64_t r) { return mlp_loss(m, mlp_input(0, r)); };
    expect_matches_reference(model, master, scratch, policy, loss_of, 2e-3);  // fp16: 2^-11 per op
  });
}

// fp16 parameters on a CPU mesh: LibTorch 2.x has fp16 matmuls on CPU, so the policy is
// accepted and training matches the reference of the same casts.
TEST(MixedPrecision, Fp16ParametersComputeOnCpu) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    Mlp model, master, scratch;
    auto policy = MixedPrecisionPolicy().param_dtype(at::kHalf).reduce_dtype(at::kFloat);
    shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh).mp_policy(policy));
    auto loss_of = [](Mlp& m, int64_t r) { return mlp_loss(m, mlp_input(0, r)); };
    expect_matches_reference(model, master, scratch, policy, loss_of, 2e-3);  // fp16: 2^-11 per op
  });
}

TEST(MixedPrecision, CollectivesMoveBytesOfTheirDtype) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto pg = mesh.get_group(0);
    auto bytes_per_step = [&](const std::optional<MixedPrecisionPolicy>& policy) {
      auto model = make_transformer();
      auto opts = fsdp::FullyShardOptions().mesh(mesh);
      if (policy) opts.mp_policy(*policy);
      shard_transformer(model, opts);
      transformer_loss(model, transformer_tokens(0, fsdp::get_rank())).backward();  // lazy init, warm-up
      pg->reset_stats();
      transformer_loss(model, transformer_tokens(1, fsdp::get_rank())).backward();
      auto s = pg->stats();
      return std::make_pair(s[CollectiveKind::kAllGather].bytes_sent, s[CollectiveKind::kReduceScatter].bytes_sent);
    };
    const auto fp32 = bytes_per_step(std::nullopt);
    const auto bf16_fp32 = bytes_per_step(bf16(at::kFloat));
    const auto bf16_bf16 = bytes_per_step(bf16(std::nullopt));
    ASSERT_GT(fp32.first, 0);
    EXPECT_EQ(bf16_fp32.first * 2, fp32.first) << "bf16 all-gathers move 2 bytes per element";
    EXPECT_EQ(bf16_fp32.second, fp32.second) << "fp32 reduce-scatters move 4 bytes per element";
    EXPECT_EQ(bf16_bf16.first * 2, fp32.first);
    EXPECT_EQ(bf16_bf16.second * 2, fp32.second) << "bf16 reduce-scatters move 2 bytes per element";
  });
}

// bf16 micro-batch gradients accumulate in fp32 without sync: the result matches an
// fp32-accumulating reference to fp32 rounding, far closer than bf16 accumulation could.
TEST(MixedPrecision, NoSyncAccumulatesInTheReduceDtype) {
  for (int world : {1, 2}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), rank = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      Mlp model, master;
      shard_mlp(model, fsdp::FullyShardOptions().mesh(mesh).mp_policy(bf16()));
      fsdp::FSDPModule root = fsdp::get_fsdp_module(*model);
      constexpr int64_t kMicroBatches = 4;
      for (int64_t mb = 0; mb < kMicroBatches; ++mb) {
        root.set_requires_gradient_sync(mb == kMicroBatches - 1);
        mlp_loss(model, mlp_input(mb, rank)).backward();
      }
      master->to(at::kBFloat16);
      std::map<std::string, at::Tensor> fp32_sum;
      for (int64_t r = 0; r < W; ++r) {
        for (int64_t mb = 0; mb < kMicroBatches; ++mb) {
          master->zero_grad();
          mlp_loss(master, mlp_input(mb, r)).backward();
          for (const auto& item : master->named_parameters()) {
            at::Tensor g = item.value().grad().to(at::kFloat);
            fp32_sum[item.key()] = fp32_sum.count(item.key()) ? fp32_sum[item.key()] + g : g;
          }
        }
      }
      for (const auto& item : model->named_parameters()) {
        const at::Tensor expected = fp32_sum[item.key()] / static_cast<double>(W);
        EXPECT_LT(relative_error(full_grad_of(item.value()), expected), 1e-5) << item.key();
      }
    });
  }
}

namespace {

// Records the dtypes its forward receives and its weight has while it computes.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& ids) {
    input_dtype = x.scalar_type();
    ids_dtype = ids.scalar_type();
    weight_dtype = lin->weight.scalar_type();
    return lin->forward(x.to(lin->weight.scalar_type()));
  }
  torch::nn::Linear lin{nullptr};
  at::ScalarType input_dtype = at::kFloat, ids_dtype = at::kFloat, weight_dtype = at::kFloat;
};
TORCH_MODULE(Probe);

}  // namespace

TEST(MixedPrecision, ForwardInputsAndOutputsAreCastAsThePolicySays) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    const at::Tensor x = at::randn({2, 4});
    const at::Tensor ids = at::zeros({2}, at::kLong);
    struct Case {
      MixedPrecisionPolicy policy;
      at::ScalarType input, weight, output;
    };
    const std::vector<Case> cases = {
        {bf16(), at::kBFloat16, at::kBFloat16, at::kBFloat16},
        {bf16().cast_forward_inputs(false), at::kFloat, at::kBFloat16, at::kBFloat16},
        {bf16().output_dtype(at::kFloat), at::kBFloat16, at::kBFloat16, at::kFloat},
        {MixedPrecisionPolicy().output_dtype(at::kBFloat16), at::kFloat, at::kFloat, at::kBFloat16},
    };
    for (const auto& c : cases) {
      Probe probe;
      fsdp::fully_shard(probe, fsdp::FullyShardOptions().mesh(mesh).mp_policy(c.policy));
      at::Tensor out = fsdp::call(probe, x, ids);
      EXPECT_EQ(probe->input_dtype, c.input) << c.policy.str();
      EXPECT_EQ(probe->ids_dtype, at::kLong) << "integer inputs are never cast";
      EXPECT_EQ(probe->weight_dtype, c.weight) << c.policy.str();
      EXPECT_EQ(out.scalar_type(), c.output) << c.policy.str();
      for (const auto& p : probe->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat) << "shards keep fp32";
      out.to(at::kFloat).sum().backward();
      for (const auto& p : probe->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        EXPECT_EQ(p.grad().scalar_type(), at::kFloat);
      }
    }
    // unshard() gathers in param_dtype.
    Probe probe;
    auto handle = fsdp::fully_shard(probe, fsdp::FullyShardOptions().mesh(mesh).mp_policy(bf16()));
    handle.unshard();
    EXPECT_EQ(probe->lin->weight.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(probe->lin->weight.equal(full_param_of(probe->parameters()[0]).to(at::kBFloat16)));
    handle.reshard();
  });
}

namespace {

// An integer parameter (a frozen lookup table) next to nothing floating: never cast.
struct TableImpl : torch::nn::Module {
  TableImpl() { table = register_parameter("table", at::arange(6, at::kLong), /*requires_grad=*/false); }
  at::Tensor forward(const at::Tensor& x) { return x + table.sum().to(x.scalar_type()); }
  at::Tensor table;
};
TORCH_MODULE(Table);

}  // namespace

TEST(MixedPrecision, PoliciesAreCheckedAndIntegerParametersNeverCast) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto expect_error = [&](const MixedPrecisionPolicy& policy, const std::string& needle) {
      Mlp m;
      try {
        fsdp::fully_shard(m, fsdp::FullyShardOptions().mesh(mesh).mp_policy(policy));
        ADD_FAILURE() << "expected an error for " << policy.str();
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
      EXPECT_FALSE(fsdp::is_fsdp_module(*m)) << "a refused policy shards nothing";
    };
    expect_error(MixedPrecisionPolicy().param_dtype(at::kInt), "param_dtype must be a floating-point dtype");
    expect_error(MixedPrecisionPolicy().reduce_dtype(at::kBool), "reduce_dtype must be a floating-point dtype");

    Table table;
    fsdp::fully_shard(table, fsdp::FullyShardOptions().mesh(mesh).mp_policy(bf16()));
    at::Tensor out = fsdp::call(table, at::zeros({2}));
    EXPECT_EQ(table->table.scalar_type(), at::kLong);
    EXPECT_EQ(out.scalar_type(), at::kBFloat16) << "the input is still cast";
    EXPECT_EQ(out[0].item<float>(), 15.0f);
  });
}

// bf16 blocks that hand fp32 to an fp32 final norm and output head (the root, no policy).
TEST(MixedPrecision, ModulesWithDifferentPoliciesTrain) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto model = make_transformer();
    auto block_policy = bf16().output_dtype(at::kFloat);
    for (auto& block : model->blocks())
      fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh).mp_policy(block_policy));
    fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
    torch::optim::Adam opt(model->parameters(), 1e-2);
    std::vector<double> losses;
    for (int64_t step = 0; step < 8; ++step) {
      opt.zero_grad();
      at::Tensor loss = transformer_loss(model, transformer_tokens(0, fsdp::get_rank()));
      loss.backward();
      losses.push_back(loss.item<double>());
      for (const auto& p : model->parameters()) {
        ASSERT_TRUE(p.grad().defined());
        ASSERT_TRUE(p.grad().isfinite().all().item<bool>());
      }
      opt.step();
    }
    EXPECT_LT(losses.back(), 0.8 * losses.front()) << "the same batch again and again: the loss must fall";
    EXPECT_EQ(model->blocks()[0]->feed_forward->w1->weight.scalar_type(), at::kBFloat16);
    EXPECT_EQ(model->output->weight.scalar_type(), at::kFloat);
  });
}

// The checkpoint holds the fp32 shards whatever the policy: bf16 -> fp32 and fp32 -> bf16.
TEST(MixedPrecision, CheckpointsLoadAcrossPolicies) {
  const std::string dir = fsdp::testing::shared_temp_path("mp_checkpoints");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
  run_distributed(2, [dir] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto trained = [&](const std::optional<MixedPrecisionPolicy>& policy) {
      auto model = make_transformer();
      auto opts = fsdp::FullyShardOptions().mesh(mesh);
      if (policy) opts.mp_policy(*policy);
      shard_transformer(model, opts);
      torch::optim::Adam opt(model->parameters(), 1e-2);
      for (int64_t step = 0; step < 2; ++step) {
        opt.zero_grad();
        transformer_loss(model, transformer_tokens(step, fsdp::get_rank())).backward();
        opt.step();
      }
      return model;
    };
    for (bool saved_in_bf16 : {true, false}) {
      auto saved = trained(saved_in_bf16 ? std::optional<MixedPrecisionPolicy>(bf16()) : std::nullopt);
      const std::string path = dir + (saved_in_bf16 ? "/from_bf16" : "/from_fp32");
      fsdp::save_checkpoint(path, fsdp::sharded_state_dict(*saved));
      auto loaded = make_transformer();
      auto opts = fsdp::FullyShardOptions().mesh(mesh);
      if (!saved_in_bf16) opts.mp_policy(bf16());
      shard_transformer(loaded, opts);
      fsdp::load_sharded_state_dict(*loaded, fsdp::load_checkpoint(path, fsdp::sharded_state_dict(*loaded)));
      auto expected = saved->named_parameters();
      for (const auto& item : loaded->named_parameters()) {
        EXPECT_EQ(item.value().scalar_type(), at::kFloat);
        EXPECT_TRUE(item.value().equal(expected[item.key()])) << item.key();
      }
      transformer_loss(loaded, transformer_tokens(5, fsdp::get_rank())).backward();  // and it trains on
    }
  });
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(dir);
}
