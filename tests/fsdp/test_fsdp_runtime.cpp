// fully_shard's runtime behaviour across real processes: how many collectives a step issues,
// what memory it holds when, clip_grad_norm_, the end-of-backward reduction, and what happens
// when the hook point is skipped.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/clip_grad.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/transformer.h>

#include "src/fsdp/policies.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <cmath>

using fsdp::CollectiveKind;
using fsdp::testing::run_distributed;

namespace {

fsdp::models::ModelArgs tiny() {
  fsdp::models::ModelArgs a;
  a.dropout_p = 0.0;
  return a;
}

fsdp::models::Transformer make_model() {
  torch::manual_seed(0);
  return fsdp::models::Transformer(tiny());
}

// Blocks, then the root; returns the handles (blocks first).
std::vector<fsdp::FSDPModule> shard(fsdp::models::Transformer& model, const fsdp::DeviceMesh& mesh,
                                    fsdp::ReshardAfterForward raf = {}) {
  std::vector<fsdp::FSDPModule> handles;
  auto opts = fsdp::FullyShardOptions().mesh(mesh).reshard_after_forward(raf);
  for (auto& block : model->blocks()) handles.push_back(fsdp::fully_shard(block, opts));
  handles.push_back(fsdp::fully_shard(model, opts));
  return handles;
}

at::Tensor tokens(int64_t step, int64_t rows = 2) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step + 1000 * fsdp::get_rank());
  return at::randint(0, 8, {rows, 16}, gen);
}

at::Tensor loss_of(fsdp::models::Transformer& model, const at::Tensor& toks) {
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
}

// Bytes of every tensor an Adam optimizer keeps per parameter, plus the parameters and grads.
int64_t training_state_bytes(torch::nn::Module& model, torch::optim::Adam& opt) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) {
    n += p.numel() * p.element_size();
    if (p.grad().defined()) n += p.grad().numel() * p.grad().element_size();
  }
  for (const auto& kv : opt.state()) {
    auto& s = static_cast<torch::optim::AdamParamState&>(*kv.second);
    n += (s.exp_avg().numel() + s.exp_avg_sq().numel()) * 4;
  }
  return n;
}

// The whole gradient of a sharded parameter, gathered from every rank's shard (collective).
at::Tensor full_grad_of(const at::Tensor& sharded_param) {
  auto d = fsdp::as_dtensor(sharded_param);
  return fsdp::DTensor::from_local(sharded_param.grad(), d.device_mesh(), d.placements(), d.sizes()).full_tensor();
}

// Every parameter's gathered gradient matches the unsharded reference module's (collective).
void expect_grads_match(torch::nn::Module& model, torch::nn::Module& ref) {
  auto ref_params = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_LT((full_grad_of(item.value()) - ref_params[item.key()].grad()).abs().max().item<double>(), 1e-6)
        << item.key();
  }
}

}  // namespace

TEST(FsdpRuntime, CollectiveCountsPerStep) {
  for (int world : {1, 2, 3}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      auto pg = mesh.get_group(0);
      auto model = make_model();
      auto handles = shard(model, mesh);
      const int64_t groups = static_cast<int64_t>(handles.size());  // 2 blocks + root
      const int64_t resharded = groups - 1;                         // the root keeps its params
      torch::optim::Adam opt(model->parameters(), 1e-3);
      for (int step = 0; step < 3; ++step) {  // step 0 has no prefetch history, later ones prefetch
        opt.zero_grad();
        pg->reset_stats();
        at::Tensor loss = loss_of(model, tokens(step));
        auto fwd = pg->stats();
        pg->reset_stats();
        loss.backward();
        auto bwd = pg->stats();
        opt.step();
        if (W == 1) {
          EXPECT_EQ(fwd.total_calls() + bwd.total_calls(), 0) << "world size 1 issues no collectives";
          continue;
        }
        EXPECT_EQ(fwd[CollectiveKind::kAllGather].calls, groups) << "step " << step;
        EXPECT_EQ(fwd[CollectiveKind::kReduceScatter].calls, 0);
        EXPECT_EQ(bwd[CollectiveKind::kReduceScatter].calls, groups) << "step " << step;
        EXPECT_EQ(bwd[CollectiveKind::kAllGather].calls, resharded) << "step " << step;
        EXPECT_EQ(fwd.total_calls() + bwd.total_calls(), 2 * groups + resharded);
      }
    });
  }
}

namespace {

// A shared layer, then two heads on its output; the loss of each head runs its own backward.
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl() {
    shared = register_module("shared", torch::nn::Linear(8, 8));
    head1 = register_module("head1", torch::nn::Linear(8, 8));
    head2 = register_module("head2", torch::nn::Linear(8, 8));
  }
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    at::Tensor h = fsdp::call(shared, x);
    return {fsdp::call(head1, h), fsdp::call(head2, h)};
  }
  torch::nn::Linear shared{nullptr}, head1{nullptr}, head2{nullptr};
};
TORCH_MODULE(TwoHeads);

}  // namespace

// The backward of head2's loss prefetches head1 (the module before it in forward), which that
// backward never reaches. With set_is_last_backward(false) the prefetched all-gather stays
// pending, as in FSDP2, and the backward of head1's loss uses it: it gathers only `shared`.
TEST(FsdpRuntime, APrefetchUnusedInOneBackwardServesTheNext) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto pg = mesh.get_group(0);
    torch::manual_seed(0);
    TwoHeads reference;
    torch::manual_seed(0);
    TwoHeads model;
    const auto opts = fsdp::FullyShardOptions().mesh(mesh);
    fsdp::fully_shard(model->shared, opts);
    fsdp::fully_shard(model->head1, opts);
    fsdp::fully_shard(model->head2, opts);
    fsdp::FSDPModule root = fsdp::fully_shard(model, opts);
    at::Tensor x = at::randn({4, 8}, at::make_generator<at::CPUGeneratorImpl>(7));  // the same on every rank

    std::vector<at::Tensor> out = fsdp::call(model, x);
    root.set_is_last_backward(false);
    pg->reset_stats();
    out[1].sum().backward({}, /*retain_graph=*/true);
    EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 3) << "head2, head1 (prefetched), shared";
    root.set_is_last_backward(true);
    pg->reset_stats();
    out[0].sum().backward();
    EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 1) << "shared only: head1 was gathered already";
    EXPECT_EQ(fsdp::get_fsdp_module(*model->head1).unsharded_parameter_bytes(), 0);

    std::vector<at::Tensor> ref_out = reference->forward(x);
    (ref_out[0].sum() + ref_out[1].sum()).backward();
    auto ref_params = reference->named_parameters();
    for (const auto& item : model->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_LT((full_grad_of(item.value()) - ref_params[item.key()].grad()).abs().max().item<double>(), 1e-6)
          << item.key();
    }
  });
}

TEST(FsdpRuntime, NoBackwardAllGatherWithoutReshardAfterForward) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto pg = mesh.get_group(0);
    auto model = make_model();
    shard(model, mesh, false);
    at::Tensor loss = loss_of(model, tokens(0));
    pg->reset_stats();
    loss.backward();
    EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 0);
    EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, 3);
  });
}

TEST(FsdpRuntime, MemoryIsFreedAndShardedStateIsOneWth) {
  for (int world : {2, 4}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      // The single-process figure: parameters + grads + Adam state of the whole model.
      int64_t full_bytes = 0;
      {
        auto ref = make_model();
        torch::optim::Adam ref_opt(ref->parameters(), 1e-3);
        loss_of(ref, tokens(0)).backward();
        ref_opt.step();
        full_bytes = training_state_bytes(*ref, ref_opt);
      }
      const int64_t before = fsdp::memory::allocated_bytes();
      auto model = make_model();
      auto handles = shard(model, mesh);
      torch::optim::Adam opt(model->parameters(), 1e-3);
      {
        at::Tensor loss = loss_of(model, tokens(0));
        // After forward: the blocks (resharded) hold no gathered storage; the root keeps its own.
        for (size_t i = 0; i + 1 < handles.size(); ++i) EXPECT_EQ(handles[i].unsharded_parameter_bytes(), 0);
        EXPECT_GT(handles.back().unsharded_parameter_bytes(), 0);
        loss.backward();
      }
      // After backward: nothing gathered, no unsharded gradient left on the module members.
      for (auto& h : handles) EXPECT_EQ(h.unsharded_parameter_bytes(), 0);
      auto& wq = model->blocks()[0]->attention->wq->weight;  // the member: the unsharded tensor
      EXPECT_EQ(wq.storage().nbytes(), 0u);
      EXPECT_FALSE(wq.grad().defined());
      EXPECT_FALSE(model->output->weight.grad().defined());
      opt.step();
      const int64_t sharded = training_state_bytes(*model, opt);
      // Every dim 0 of the tiny model divides 2 and 4, so there is no padding: exactly 1/W.
      EXPECT_EQ(sharded * W, full_bytes);
      // The allocator agrees: what this rank holds now is its shards, grads and Adam state
      // (the shards and grads are views of the flat buffers they are counted in).
      const int64_t live = fsdp::memory::allocated_bytes() - before;
      EXPECT_GE(live, sharded);
      EXPECT_LE(live, sharded + sharded / 5 + (64 << 10)) << "live " << live << " sharded " << sharded;
    });
  }
}

TEST(FsdpRuntime, ClipGradNormMatchesSingleProcess) {
  for (int world : {2, 3}) {
    run_distributed(world, [] {
      const int W = fsdp::get_world_size(), r = fsdp::get_rank();
      auto mesh = fsdp::init_device_mesh("cpu", {W});
      auto ref = make_model();
      auto model = make_model();
      shard(model, mesh);
      auto global = at::randint(0, 8, {2 * W, 16}, at::make_generator<at::CPUGeneratorImpl>(7));
      for (double p : {2.0, 1.0, static_cast<double>(INFINITY)}) {
        ref->zero_grad();
        loss_of(ref, global).backward();
        model->zero_grad();
        loss_of(model, global.slice(0, 2 * r, 2 * r + 2)).backward();
        const double expect = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05, p);
        const double got = fsdp::clip_grad_norm_(model->parameters(), 0.05, p);
        EXPECT_NEAR(got, expect, 1e-5 * std::max(1.0, expect)) << "norm " << p;
        auto ref_params = ref->named_parameters();
        for (const auto& item : model->named_parameters()) {
          EXPECT_LT((full_grad_of(item.value()) - ref_params[item.key()].grad()).abs().max().item<double>(), 1e-6)
              << item.key() << " norm " << p;
        }
      }
    });
  }
}

TEST(FsdpRuntime, RootAndNoGradInputGroupsAreReducedAtEndOfBackward) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto ref = make_model();
    auto model = make_model();
    shard(model, mesh);
    auto global = at::randint(0, 8, {4, 16}, at::make_generator<at::CPUGeneratorImpl>(11));
    loss_of(ref, global).backward();
    // Token ids need no grad, so the root group's post-backward hook can never fire: only the
    // end-of-backward pass can reduce the embeddings, the final norm and the output layer.
    loss_of(model, global.slice(0, 2 * fsdp::get_rank(), 2 * fsdp::get_rank() + 2)).backward();
    auto ref_params = ref->named_parameters();
    for (const std::string name : {"tok_embeddings.weight", "pos_embeddings.weight", "norm.weight", "output.weight"}) {
      const at::Tensor p = model->named_parameters()[name];  // a copy: the dict is a temporary
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_LT((full_grad_of(p) - ref_params[name].grad()).abs().max().item<double>(), 1e-6) << name;
    }
  });
}

namespace {
// Calls an FSDP submodule directly, skipping the hook point.
struct SkipsHookImpl : torch::nn::Module {
  SkipsHookImpl() {
    inner = register_module("inner", torch::nn::Linear(4, 6));
    outer = register_module("outer", torch::nn::Linear(6, 2));
  }
  at::Tensor forward(const at::Tensor& x) { return fsdp::call(outer, inner->forward(x)); }
  torch::nn::Linear inner{nullptr}, outer{nullptr};
};
TORCH_MODULE(SkipsHook);
}  // namespace

TEST(FsdpRuntime, SkippingTheHookPointIsANamedError) {
  run_distributed(2, [] {
    SkipsHook m;
    fsdp::fully_shard(m->inner);
    fsdp::fully_shard(m);
    try {
      fsdp::call(m, at::ones({3, 4}));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'inner'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("fsdp::call"), std::string::npos) << msg;
    }
  });
}

TEST(FsdpRuntime, ManualUnshardAndReshard) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    torch::manual_seed(0);
    torch::nn::Linear plain(5, 3);
    torch::manual_seed(0);
    torch::nn::Linear lin(5, 3);
    auto h = fsdp::fully_shard(lin, fsdp::FullyShardOptions().mesh(mesh));
    EXPECT_EQ(h.unsharded_parameter_bytes(), 0);
    EXPECT_TRUE(fsdp::get_fsdp_module(*lin) == h);
    EXPECT_FALSE(fsdp::is_fsdp_module(*plain));
    // The module's member (the unsharded tensor) leads to the same DTensor as the registered shard.
    EXPECT_EQ(fsdp::as_dtensor(lin->weight).sizes(), (std::vector<int64_t>{3, 5}));
    EXPECT_TRUE(fsdp::as_dtensor(lin->weight).to_local().is_same(lin->named_parameters()["weight"]));
    EXPECT_TRUE(h.mesh() == mesh);
    auto handle = h.unshard(/*async_op=*/true);
    handle.wait();
    EXPECT_GT(h.unsharded_parameter_bytes(), 0);
    at::Tensor x = at::randn({4, 5});
    EXPECT_TRUE(lin->forward(x).allclose(plain->forward(x)));  // usable directly once unsharded
    h.reshard();
    EXPECT_EQ(h.unsharded_parameter_bytes(), 0);
    EXPECT_THROW(fsdp::get_fsdp_module(*plain), c10::Error);
  });
}

namespace {
// a -> a -> b -> head, with {a, b} sharded as one group: the group's forward is one round
// that ends when both modules have run, however often a runs first.
struct RepeatsFirstOfGroupImpl : torch::nn::Module {
  RepeatsFirstOfGroupImpl() {
    a = register_module("a", torch::nn::Linear(6, 6));
    b = register_module("b", torch::nn::Linear(6, 6));
    head = register_module("head", torch::nn::Linear(6, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::tanh(fsdp::call(a, x));
    h = at::tanh(fsdp::call(a, h));
    return fsdp::call(head, at::tanh(fsdp::call(b, h)));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, head{nullptr};
};
TORCH_MODULE(RepeatsFirstOfGroup);
}  // namespace

TEST(FsdpRuntime, GroupOfModulesGathersOnceWhenItsFirstModuleRunsTwice) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto pg = mesh.get_group(0);
    torch::manual_seed(0);
    RepeatsFirstOfGroup ref;
    torch::manual_seed(0);
    RepeatsFirstOfGroup model;
    auto opts = fsdp::FullyShardOptions().mesh(mesh);
    fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->a.ptr(), model->b.ptr()}, opts);
    fsdp::fully_shard(model, opts);
    at::Tensor global = at::randn({4, 6}, at::make_generator<at::CPUGeneratorImpl>(5));
    ref->forward(global).pow(2).mean().backward();

    pg->reset_stats();
    at::Tensor local = global.slice(0, 2 * fsdp::get_rank(), 2 * fsdp::get_rank() + 2);
    at::Tensor loss = fsdp::call(model, local).pow(2).mean();
    EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 2) << "one per group: {a, b} and the root";
    pg->reset_stats();
    loss.backward();
    EXPECT_EQ(pg->stats()[CollectiveKind::kAllGather].calls, 1) << "only {a, b} resharded after forward";
    EXPECT_EQ(pg->stats()[CollectiveKind::kReduceScatter].calls, 2) << "one per group";

    expect_grads_match(*model, *ref);
  });
}

// The head's forward prefetch names the blocks that ran before it: their all-gathers are issued
// during the head's forward and kept for their backward, which uses them instead of gathering
// again (FSDP2 keeps such an unshard pending too), so a step issues as many all-gathers as without
// the list. A forward under no-grad has no backward to use them: they are dropped at its end.
TEST(FsdpRuntime, AForwardPrefetchOfBlocksThatRanIsKeptForTheirBackward) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto ref = make_model();
    auto global = at::randint(0, 8, {4, 16}, at::make_generator<at::CPUGeneratorImpl>(17));
    loss_of(ref, global).backward();
    const int r = fsdp::get_rank();
    const at::Tensor local = global.slice(0, 2 * r, 2 * r + 2);
    auto opts = fsdp::FullyShardOptions().mesh(mesh);
    int64_t calls[2] = {0, 0};
    for (bool listed : {false, true}) {
      auto model = make_model();
      std::vector<fsdp::FSDPModule> blocks;
      for (auto& block : model->blocks()) blocks.push_back(fsdp::fully_shard(block, opts));
      auto head =
          fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->norm.ptr(), model->output.ptr()},
                            fsdp::FullyShardOptions().mesh(mesh).reshard_after_forward(false));
      fsdp::fully_shard(model, opts);
      if (listed) head.set_modules_to_forward_prefetch(std::vector<fsdp::FSDPModule>(blocks.rbegin(), blocks.rend()));
      auto pg = mesh.get_group(0);
      pg->reset_stats();
      loss_of(model, local).backward();
      calls[listed] = pg->stats()[CollectiveKind::kAllGather].calls;
      expect_grads_match(*model, *ref);
      for (auto& b : blocks) EXPECT_EQ(b.unsharded_parameter_bytes(), 0);
      if (listed) {
        torch::NoGradGuard no_grad;
        loss_of(model, local);
        for (auto& b : blocks)
          EXPECT_EQ(b.unsharded_parameter_bytes(), 0) << "no backward: dropped at the forward's end";
      }
    }
    EXPECT_EQ(calls[1], calls[0]) << "the blocks' backward all-gathers were the head's forward prefetches";
  });
}

TEST(FsdpRuntime, AHandleOutlivesItsModule) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto opts = fsdp::FullyShardOptions().mesh(mesh);
    torch::nn::Linear kept(4, 4);
    auto kept_handle = fsdp::fully_shard(kept, opts);
    fsdp::FSDPModule gone_handle;
    {
      torch::nn::Linear gone(4, 4);
      gone_handle = fsdp::fully_shard(gone, opts);
    }
    EXPECT_TRUE(gone_handle.valid());
    EXPECT_EQ(gone_handle.module(), nullptr);
    // Naming it as a prefetch target neither crashes nor prefetches anything.
    kept_handle.set_modules_to_forward_prefetch({gone_handle});
    kept_handle.set_modules_to_backward_prefetch({gone_handle});
    fsdp::call(kept, at::ones({2, 4})).sum().backward();
    EXPECT_TRUE(kept->named_parameters()["weight"].grad().defined());
  });
}

TEST(FsdpRuntime, UnshardingAChildBeforeTheFirstForwardKeepsTheRoot) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    auto ref = make_model();
    auto model = make_model();
    auto handles = shard(model, mesh);
    handles.front().unshard(/*async_op=*/true);  // the first block, before anything ran; its pre-forward waits
    auto global = at::randint(0, 8, {4, 16}, at::make_generator<at::CPUGeneratorImpl>(13));
    loss_of(ref, global).backward();
    const int r = fsdp::get_rank();
    loss_of(model, global.slice(0, 2 * r, 2 * r + 2)).backward();  // the root's forward is still the root
    expect_grads_match(*model, *ref);
    for (auto& h : handles) {
      if (!(h == handles.back())) {
        EXPECT_EQ(h.unsharded_parameter_bytes(), 0);
      }
    }
  });
}

TEST(FsdpRuntime, AGroupOfModulesCannotBeTheRoot) {
  run_distributed(2, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2});
    RepeatsFirstOfGroup model;
    fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->a.ptr(), model->b.ptr()},
                      fsdp::FullyShardOptions().mesh(mesh));
    try {
      fsdp::call(model->a, at::ones({2, 6}));
      FAIL() << "expected an error";
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("single root module"), std::string::npos) << msg;
      EXPECT_NE(msg.find("2 modules"), std::string::npos) << msg;
    }
  });
}

TEST(FsdpRuntime, TheDefaultMeshFollowsANewProcessGroup) {
  // One process: init, shard on the default mesh, tear down, init again.
  fsdp::init_process_group();
  torch::nn::Linear first(3, 3);
  const auto first_group = fsdp::fully_shard(first).mesh().get_group(0);
  const fsdp::RendezvousInfo info = fsdp::rendezvous_info();  // a copy: outlives the runtime
  fsdp::destroy_process_group();
  EXPECT_EQ(info.world_size, 1);
  fsdp::init_process_group();
  torch::nn::Linear second(3, 3);
  const auto second_group = fsdp::fully_shard(second).mesh().get_group(0);
  EXPECT_NE(first_group.get(), second_group.get()) << "the default mesh must be made in the new world";
  fsdp::call(second, at::ones({1, 3})).sum().backward();
  EXPECT_TRUE(second->named_parameters()["weight"].grad().defined());
  fsdp::destroy_process_group();
}

// The root's pre-forward moves tensor inputs to the mesh's device, as FSDP2 does on an
// accelerator: every defined tensor not there, through an autograd op; nothing on a CPU mesh.
// The meta device stands in for an accelerator here.
TEST(FsdpRuntime, RootInputsMoveToTheMeshDeviceOnAnAcceleratorOnly) {
  const at::Tensor x = at::randn({2, 3}).requires_grad_(true);
  const at::Tensor tokens = at::arange(4, at::kLong);
  std::vector<at::Tensor> on_cpu = {x, tokens, at::Tensor()};
  fsdp::detail::move_inputs_to_device(on_cpu, c10::Device(c10::kCPU));
  EXPECT_TRUE(on_cpu[0].is_same(x));
  EXPECT_TRUE(on_cpu[1].is_same(tokens));

  const at::Tensor already = at::empty({5}, at::TensorOptions().device(c10::kMeta));
  std::vector<at::Tensor> inputs = {x, tokens, at::Tensor(), already};
  fsdp::detail::move_inputs_to_device(inputs, c10::Device(c10::kMeta));
  EXPECT_TRUE(inputs[0].is_meta());
  EXPECT_EQ(inputs[0].sizes(), x.sizes());
  EXPECT_EQ(inputs[0].scalar_type(), at::kFloat);
  EXPECT_TRUE(inputs[0].requires_grad() && inputs[0].grad_fn()) << "a gradient flows back to the input";
  EXPECT_TRUE(inputs[1].is_meta());
  EXPECT_EQ(inputs[1].scalar_type(), at::kLong);
  EXPECT_FALSE(inputs[2].defined());
  EXPECT_TRUE(inputs[3].is_same(already));
}
