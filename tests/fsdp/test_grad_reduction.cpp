// FSDPModule's gradient-reduction controls across real processes: which parameters enter the
// reduce-scatter, unused parameters and ranks whose backward skips a module, the timeout when
// they do without the setting, micro-batches that do not finalize, modules not gathered in
// backward, a separate reduce-scatter group and the bound on reductions in flight. Each result
// is compared with a single-process reference that computes every rank's loss.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

using fsdp::CollectiveKind;
using fsdp::testing::run_distributed;

namespace {

constexpr int64_t kDim = 8;

// x -> tanh(block_i(x)) for every block -> head (if any). Block `skip` still runs forward (its
// all-gather must match the other ranks') but its output is dropped, so backward never reaches
// it. `on_block_input_grad` runs when the gradient of a block's input arrives, i.e. right after
// that block's post-backward.
struct ChainImpl : torch::nn::Module {
  ChainImpl(int64_t n_blocks, bool with_head) {
    torch::manual_seed(7);
    for (int64_t i = 0; i < n_blocks; ++i) {
      blocks.push_back(register_module("blocks" + std::to_string(i), torch::nn::Linear(kDim, kDim)));
    }
    if (with_head) head = register_module("head", torch::nn::Linear(kDim, 3));
  }
  at::Tensor forward(at::Tensor x, int64_t skip) {
    at::Tensor h = x;
    for (size_t i = 0; i < blocks.size(); ++i) {
      if (on_block_input_grad && h.requires_grad()) {
        auto cb = on_block_input_grad;
        h.register_hook([cb](const at::Tensor&) { cb(); });
      }
      at::Tensor out = torch::tanh(fsdp::call(blocks[i], h));
      if (static_cast<int64_t>(i) != skip) h = out;
    }
    return head ? head->forward(h) : h;
  }
  std::vector<torch::nn::Linear> blocks;
  torch::nn::Linear head{nullptr};
  std::function<void()> on_block_input_grad;
};
TORCH_MODULE(Chain);

// fully_shard on every block, then on the root; returns the root's handle.
fsdp::FSDPModule shard_chain(Chain& model, const fsdp::DeviceMesh& mesh) {
  auto opts = fsdp::FullyShardOptions().mesh(mesh);
  for (auto& block : model->blocks) fsdp::fully_shard(block, opts);
  return fsdp::fully_shard(model, opts);
}

at::Tensor input_of(int64_t rank, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + 10 * step + rank);
  return at::randn({4, kDim}, gen);
}

at::Tensor loss_of(Chain& model, int64_t rank, int64_t step, int64_t skip) {
  return fsdp::call(model, input_of(rank, step), skip).pow(2).sum();
}

// What FSDP computes, in one process: the mean over the ranks of their losses.
void reference_backward(Chain& ref, int64_t world, int64_t step, const std::function<int64_t(int64_t)>& skip_of) {
  at::Tensor total = at::zeros({});
  for (int64_t r = 0; r < world; ++r) total = total + loss_of(ref, r, step, skip_of(r));
  (total / world).backward();
}

at::Tensor full_of(const at::Tensor& sharded_param) { return fsdp::as_dtensor(sharded_param).full_tensor(); }

at::Tensor full_grad_of(const at::Tensor& sharded_param) {
  auto d = fsdp::as_dtensor(sharded_param);
  return fsdp::DTensor::from_local(sharded_param.grad(), d.device_mesh(), d.placements(), d.sizes()).full_tensor();
}

// The sharded parameter `name` (a module's member, e.g. LinearImpl::weight, is the unsharded one).
at::Tensor sharded(torch::nn::Module& model, const std::string& name) { return model.named_parameters()[name]; }

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Every gradient (and its absence) matches the reference's. Collective.
void expect_grads_match(torch::nn::Module& model, torch::nn::Module& ref) {
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const at::Tensor& want = ref_params[item.key()].grad();
    ASSERT_EQ(item.value().grad().defined(), want.defined()) << item.key();
    if (want.defined()) {
      EXPECT_LT(max_diff(full_grad_of(item.value()), want), 1e-5) << item.key();
    }
  }
}

// Every parameter matches the reference's. Collective.
void expect_params_match(torch::nn::Module& model, torch::nn::Module& ref, int64_t step) {
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    EXPECT_LT(max_diff(full_of(item.value()), ref_params[item.key()]), 1e-5) << item.key() << " step " << step;
  }
}

// Linear `used` feeds the output; Linear `unused` is in the same group but never called.
struct TwoLinearsImpl : torch::nn::Module {
  TwoLinearsImpl() {
    torch::manual_seed(3);
    used = register_module("used", torch::nn::Linear(kDim, kDim));
    unused = register_module("unused", torch::nn::Linear(kDim, kDim));
  }
  at::Tensor forward(const at::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};
TORCH_MODULE(TwoLinears);

}  // namespace

// ------------------------------------------------------------------------------ which params reduce

TEST(GradReduction, AParameterWithoutAGradientKeepsNone) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      TwoLinears model;
      fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(fsdp::init_device_mesh("cpu", {W})));
      const at::Tensor before = full_of(sharded(*model, "unused.weight"));
      torch::optim::Adam opt(model->parameters(), 1e-2);
      for (int64_t step = 0; step < 2; ++step) {
        opt.zero_grad();
        fsdp::call(model, input_of(r, step)).pow(2).sum().backward();
        EXPECT_TRUE(sharded(*model, "used.weight").grad().defined());
        EXPECT_FALSE(sharded(*model, "unused.weight").grad().defined())
            << "FSDP gives no gradient to a parameter that got none";
        EXPECT_FALSE(sharded(*model, "unused.bias").grad().defined());
        opt.step();
      }
      EXPECT_TRUE(full_of(sharded(*model, "unused.weight")).equal(before))
          << "Adam leaves a parameter without a gradient alone";
    });
  }
}

TEST(GradReduction, OnlyTrainableParametersEnterTheReduceScatter) {
  for (int world : {2, 3, 4}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      TwoLinears model, ref;
      for (auto* m : {&model, &ref}) {  // only the biases train
        (*m)->used->weight.set_requires_grad(false);
        (*m)->unused->weight.set_requires_grad(false);
      }
      fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
      auto pg = mesh.get_group(0);
      pg->reset_stats();
      fsdp::call(model, input_of(r, 0)).pow(2).sum().backward();
      const auto rs = pg->stats()[CollectiveKind::kReduceScatter];
      EXPECT_EQ(rs.calls, 1);
      // The ring reduce-scatter sends its output's size W - 1 times. The output holds the padded
      // shard of the one bias with a gradient: the frozen weights and the unused bias take no room.
      const int64_t bias_shard = (kDim + W - 1) / W;
      EXPECT_EQ(rs.bytes_sent, (W - 1) * bias_shard * 4);
      at::Tensor total = at::zeros({});
      for (int64_t q = 0; q < W; ++q) total = total + fsdp::call(ref, input_of(q, 0)).pow(2).sum();
      (total / W).backward();
      EXPECT_LT(max_diff(full_grad_of(sharded(*model, "used.bias")), ref->used->bias.grad()), 1e-5);
      EXPECT_FALSE(sharded(*model, "unused.bias").grad().defined());
      EXPECT_FALSE(sharded(*model, "used.weight").grad().defined());
    });
  }
}

TEST(GradReduction, UnusedParametersGetZeroGradientsWhenReduced) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      TwoLinears model;
      auto root = fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
      root.set_reduce_scatter_unused_params(true);
      auto pg = mesh.get_group(0);
      pg->reset_stats();
      fsdp::call(model, input_of(r, 0)).pow(2).sum().backward();
      ASSERT_TRUE(sharded(*model, "unused.weight").grad().defined());
      ASSERT_TRUE(sharded(*model, "unused.bias").grad().defined());
      EXPECT_EQ(full_grad_of(sharded(*model, "unused.weight")).abs().max().item<double>(), 0.0);
      EXPECT_EQ(sharded(*model, "unused.weight").grad().sizes(), sharded(*model, "unused.weight").sizes());
      if (W > 1) {  // all four parameters' padded shards
        const int64_t shard = (kDim + W - 1) / W;
        EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].bytes_sent, (W - 1) * 2 * (shard * kDim + shard) * 4);
      }
    });
  }
}

// ------------------------------------------------------------------------------ divergent control flow

// Rank 1's backward skips block `skip` of five equal blocks. With unused parameters reduced,
// every rank issues the same reduce-scatters in the same order, and training matches the
// reference step after step.
TEST(GradReduction, ARankThatSkipsABlockTrainsWhenUnusedParametersAreReduced) {
  for (int world : {2, 3}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      struct Case {
        int64_t skip;
        bool separate_group;
      };
      // The skipping rank's backward all-gathers come at other points of its reduce-scatters
      // than the other ranks' (their prefetches differ), so both must not share one sequence:
      // the reduce-scatters get a group of their own.
      for (Case c : {Case{2, true}, Case{0, true}, Case{4, true}}) {
        SCOPED_TRACE("skip " + std::to_string(c.skip));
        auto skip_of = [&](int64_t rank) { return rank == 1 ? c.skip : int64_t{-1}; };
        Chain model(5, true), ref(5, true);
        auto root = shard_chain(model, mesh);
        root.set_reduce_scatter_unused_params(true);
        if (c.separate_group) root.set_separate_reduce_scatter_group();
        torch::optim::Adam opt(model->parameters(), 1e-2), ref_opt(ref->parameters(), 1e-2);
        for (int64_t step = 0; step < 3; ++step) {
          opt.zero_grad();
          ref_opt.zero_grad();
          loss_of(model, r, step, skip_of(r)).backward();
          reference_backward(ref, W, step, skip_of);
          expect_grads_match(*model, *ref);
          opt.step();
          ref_opt.step();
          expect_params_match(*model, *ref, step);
        }
      }
    });
  }
}

// The same divergence without the setting: rank 0 issues one reduce-scatter more than rank 1,
// which the collective timeout turns into an error naming the op, the group, the rank that did
// not arrive, the FSDP module and the setting that fixes it.
TEST(GradReduction, ASkippedBlockWithoutTheSettingFailsAtTheTimeout) {
  fsdp::testing::DistOptions opts;
  opts.collective_timeout = std::chrono::milliseconds(1500);
  run_distributed(
      2,
      [] {
        const int64_t r = fsdp::get_rank();
        auto mesh = fsdp::init_device_mesh("cpu", {2});
        Chain model(3, /*with_head=*/false);  // the root holds no parameters: no reduce-scatter of its own
        shard_chain(model, mesh);
        at::Tensor loss = loss_of(model, r, 0, r == 1 ? 1 : -1);
        if (r == 1) {
          loss.backward();  // pairs its two reduce-scatters with rank 0's first two; then stays alive
          std::this_thread::sleep_for(std::chrono::milliseconds(6000));
          return;
        }
        try {
          loss.backward();
          FAIL() << "expected the unmatched reduce-scatter to time out";
        } catch (const fsdp::CollectiveError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("reduce_scatter #"), std::string::npos) << msg;
          EXPECT_NE(msg.find("'" + mesh.get_group(0)->name() + "'"), std::string::npos) << msg;
          EXPECT_NE(msg.find("did not arrive: [1]"), std::string::npos) << msg;
          EXPECT_NE(msg.find("FSDP module 'blocks0'"), std::string::npos) << msg;
          EXPECT_NE(msg.find("set_reduce_scatter_unused_params(true)"), std::string::npos) << msg;
        }
      },
      opts);
}

// ------------------------------------------------------------------------------ micro-batches

TEST(GradReduction, IsLastBackwardFalseLeavesReductionsPendingUntilTheLastBackward) {
  for (int world : {1, 2, 4}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      Chain model(3, true), ref(3, true);
      auto root = shard_chain(model, fsdp::init_device_mesh("cpu", {W}));
      root.set_is_last_backward(false);  // before the first forward: applies at lazy initialisation
      torch::optim::Adam opt(model->parameters(), 1e-2), ref_opt(ref->parameters(), 1e-2);
      for (int64_t step = 0; step < 2; ++step) {
        opt.zero_grad();
        ref_opt.zero_grad();
        root.set_is_last_backward(false);
        loss_of(model, r, 2 * step, -1).backward();
        // The root reduces last, at the end of backward, and nothing waits for it there.
        EXPECT_EQ(root.reductions_in_flight(), W > 1 ? 1 : 0);
        root.set_is_last_backward(true);
        loss_of(model, r, 2 * step + 1, -1).backward();
        EXPECT_EQ(root.reductions_in_flight(), 0) << "the last backward writes every gradient";
        reference_backward(ref, W, 2 * step, [](int64_t) { return int64_t{-1}; });
        reference_backward(ref, W, 2 * step + 1, [](int64_t) { return int64_t{-1}; });
        expect_grads_match(*model, *ref);
        opt.step();
        ref_opt.step();
        expect_params_match(*model, *ref, step);
      }
    });
  }
}

// ------------------------------------------------------------------------------ unshard in backward

namespace {

// x + shift: the gradient of `shift` needs no value of it.
struct ShiftImpl : torch::nn::Module {
  ShiftImpl() { shift = register_parameter("shift", at::randn({kDim})); }
  at::Tensor forward(const at::Tensor& x) { return x + shift; }
  at::Tensor shift;
};
TORCH_MODULE(Shift);

struct ShiftedImpl : torch::nn::Module {
  ShiftedImpl() {
    torch::manual_seed(5);
    first = register_module("first", torch::nn::Linear(kDim, kDim));
    middle = register_module("middle", Shift());
    last = register_module("last", torch::nn::Linear(kDim, kDim));
    head = register_module("head", torch::nn::Linear(kDim, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::tanh(fsdp::call(first, x));
    h = fsdp::call(middle, h);
    return head->forward(torch::tanh(fsdp::call(last, h)));
  }
  torch::nn::Linear first{nullptr};
  Shift middle{nullptr};
  torch::nn::Linear last{nullptr}, head{nullptr};
};
TORCH_MODULE(Shifted);

}  // namespace

TEST(GradReduction, UnshardInBackwardFalseSkipsTheBackwardAllGather) {
  for (int world : {2, 3}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      auto pg = mesh.get_group(0);
      for (bool unshard_in_backward : {true, false}) {
        Shifted model, ref;
        auto opts = fsdp::FullyShardOptions().mesh(mesh);
        fsdp::fully_shard(model->first, opts);
        auto middle = fsdp::fully_shard(model->middle, opts);
        fsdp::fully_shard(model->last, opts);
        fsdp::fully_shard(model, opts);
        middle.set_unshard_in_backward(unshard_in_backward);
        torch::optim::Adam opt(model->parameters(), 1e-2), ref_opt(ref->parameters(), 1e-2);
        for (int64_t step = 0; step < 2; ++step) {
          opt.zero_grad();
          ref_opt.zero_grad();
          at::Tensor loss = fsdp::call(model, input_of(r, step)).pow(2).sum();
          pg->reset_stats();
          loss.backward();
          // The three resharded blocks are gathered again in backward, but for `middle` only
          // when it is unsharded in backward (neither its pre-backward nor a prefetch gathers it).
          EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, unshard_in_backward ? 3 : 2);
          EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, 4) << "its gradient is reduced all the same";
          at::Tensor total = at::zeros({});
          for (int64_t q = 0; q < W; ++q) total = total + fsdp::call(ref, input_of(q, step)).pow(2).sum();
          (total / W).backward();
          expect_grads_match(*model, *ref);
          opt.step();
          ref_opt.step();
        }
      }
    });
  }
}

// ------------------------------------------------------------------------------ the reduce-scatter group

TEST(GradReduction, SeparateReduceScatterGroupCarriesEveryReduceScatter) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      auto pg = mesh.get_group(0);
      Chain model(3, true), ref(3, true);
      auto root = shard_chain(model, mesh);
      root.set_separate_reduce_scatter_group();
      auto rs_group = root.reduce_scatter_group();
      auto block = fsdp::get_fsdp_module(*model->blocks[1]);
      if (W == 1) {
        EXPECT_EQ(rs_group, pg) << "a mesh of one rank reduces nothing, so no group is made";
      } else {
        EXPECT_NE(rs_group, pg);
        EXPECT_EQ(rs_group->global_ranks(), pg->global_ranks());
        EXPECT_EQ(block.reduce_scatter_group(), rs_group) << "one group for the whole call";
      }
      torch::optim::Adam opt(model->parameters(), 1e-2), ref_opt(ref->parameters(), 1e-2);
      for (int64_t step = 0; step < 3; ++step) {
        if (step == 2) root.set_separate_reduce_scatter_group(false);  // back to the mesh's group
        opt.zero_grad();
        ref_opt.zero_grad();
        pg->reset_stats();
        rs_group->reset_stats();
        loss_of(model, r, step, -1).backward();
        if (W > 1) {
          const bool separate = step < 2;
          EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, separate ? 0 : 4) << "step " << step;
          EXPECT_EQ(rs_group->stats()[CollectiveKind::kReduceScatter].calls, separate ? 4 : 0) << "step " << step;
          EXPECT_EQ(rs_group->stats()[CollectiveKind::kAllGather].calls, 0);
          // The four groups' forward all-gathers and the three blocks' backward ones.
          EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 4 + 3);
        }
        reference_backward(ref, W, step, [](int64_t) { return int64_t{-1}; });
        expect_grads_match(*model, *ref);
        opt.step();
        ref_opt.step();
        expect_params_match(*model, *ref, step);
      }
    });
  }
}

// ------------------------------------------------------------------------------ reductions in flight

TEST(GradReduction, MaxInputBuffersBoundsTheReductionsInFlight) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      const int64_t W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      for (int k : {1, 3}) {
        SCOPED_TRACE("k = " + std::to_string(k));
        Chain model(4, true), ref(4, true);
        auto root = shard_chain(model, mesh);
        EXPECT_THROW(root.set_reduce_scatter_max_input_buffers(0), c10::Error);
        EXPECT_THROW(root.set_reduce_scatter_max_input_buffers(-2), c10::Error);
        root.set_reduce_scatter_max_input_buffers(k);
        // Right after each block's post-backward: how many reductions are in flight, and how many
        // blocks reduced before it already have their gradients written.
        int64_t max_in_flight = 0, reduced = 0;
        model->on_block_input_grad = [&] {
          ++reduced;
          const int64_t in_flight = root.reductions_in_flight();
          max_in_flight = std::max(max_in_flight, in_flight);
          int64_t written = 0;
          for (size_t i = 0; i < model->blocks.size(); ++i) {
            written += sharded(*model, "blocks" + std::to_string(i) + ".weight").grad().defined() ? 1 : 0;
          }
          EXPECT_GE(written, reduced - k) << "issuing one more reduce-scatter first finishes the oldest";
          if (W > 1 && k == 1) {
            EXPECT_EQ(written, reduced - in_flight);
          }
        };
        loss_of(model, r, 0, -1).backward();
        EXPECT_EQ(reduced, 3) << "blocks 3, 2 and 1 (block 0's input needs no gradient)";
        EXPECT_LE(max_in_flight, k);
        EXPECT_EQ(root.reductions_in_flight(), 0);
        reference_backward(ref, W, 0, [](int64_t) { return int64_t{-1}; });
        expect_grads_match(*model, *ref);
      }
    });
  }
}
