// The controls over an FSDP tree's communication and iteration state: reset_iter_state()
// after an exception in forward or backward, share_comm_ctx() for several roots, custom
// all-gather and reduce-scatter objects, and the process-group allocation flag. Training
// follows single-process training on the global batch throughout.
#include "harness/multiprocess.h"
#include "parity_training.h"

#include <fsdp/call.h>
#include <fsdp/custom_comm.h>
#include <fsdp/distributed.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/fully_shard.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>

using fsdp::testing::expect_training_parity;
using fsdp::testing::parity_loss;
using fsdp::testing::ParityOptions;
using fsdp::testing::run_distributed;

namespace {

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing: " << needle;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A layer that throws when told to: in its forward, or in its backward (a gradient hook on an
// inner activation, so the backward fails after its pre-backward all-gather ran).
struct FlakyImpl : torch::nn::Module {
  FlakyImpl(int64_t in, int64_t out) { lin = register_module("lin", torch::nn::Linear(in, out)); }
  at::Tensor forward(const at::Tensor& x) {
    TORCH_CHECK(!fail_forward, "injected forward failure");
    at::Tensor h = lin->forward(x);
    if (fail_backward) h.register_hook([](const at::Tensor&) { TORCH_CHECK(false, "injected backward failure"); });
    return at::tanh(h);
  }
  torch::nn::Linear lin{nullptr};
  bool fail_forward = false;
  bool fail_backward = false;
};
TORCH_MODULE(Flaky);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    l1 = register_module("l1", torch::nn::Linear(5, 7));
    mid = register_module("mid", Flaky(7, 7));
    l3 = register_module("l3", torch::nn::Linear(7, 3));
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(fsdp::call(l1, x));
    h = fsdp::call(mid, h);
    h = fsdp::call(l3, h);
    pause_in_backward(h, pause_before_l3_backward);
    return fsdp::call(head, at::relu(h));
  }
  // Backward stops this long when it reaches `t`'s gradient: a rank made late on purpose.
  static void pause_in_backward(at::Tensor& t, std::chrono::milliseconds pause) {
    if (pause.count() > 0) t.register_hook([pause](const at::Tensor&) { std::this_thread::sleep_for(pause); });
  }
  torch::nn::Linear l1{nullptr};
  Flaky mid{nullptr};
  torch::nn::Linear l3{nullptr}, head{nullptr};
  std::chrono::milliseconds pause_before_l3_backward{0};
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(0);
  return Net();
}

fsdp::FSDPModule shard_net(Net& net) {
  fsdp::fully_shard(net->l1);
  fsdp::fully_shard(net->mid);
  fsdp::fully_shard(net->l3);
  return fsdp::fully_shard(net);
}

at::Tensor net_forward(torch::nn::Module& m, const at::Tensor& x) { return fsdp::call(dynamic_cast<NetImpl*>(&m), x); }

}  // namespace

TEST(ResetIterState, AfterAnExceptionInForwardTrainingGoesOn) {
  for (int world : {1, 2, 3, 4}) {
    run_distributed(world, [] {
      Net reference = make_net();
      Net model = make_net();
      fsdp::FSDPModule root = shard_net(model);
      root.reset_iter_state();  // before the first forward: nothing to reset
      ParityOptions o;
      o.steps = 5;
      o.before_step = [&](int step, const at::Tensor& local) {
        if (step != 2) return true;
        model->mid->fail_forward = true;  // on every rank, after l1 ran and mid was gathered
        expect_error([&] { fsdp::call(model, local); }, "injected forward failure");
        model->mid->fail_forward = false;
        expect_error([&] { fsdp::call(model, local); }, "Call reset_iter_state() on the root FSDPModule");
        root.reset_iter_state();
        return false;  // the reference skips this step
      };
      expect_training_parity(reference.ptr(), model.ptr(), net_forward, "forward failure", o);
      EXPECT_EQ(root.reductions_in_flight(), 0);
    });
  }
}

TEST(ResetIterState, AfterAnExceptionInBackwardTrainingGoesOn) {
  run_distributed(2, [] {
    Net reference = make_net();
    Net model = make_net();
    fsdp::FSDPModule root = shard_net(model);
    ParityOptions o;
    o.steps = 5;
    o.before_step = [&](int step, const at::Tensor& local) {
      if (step != 2) return true;
      // A no-sync micro-batch first: its accumulated gradients must be dropped too.
      root.set_requires_gradient_sync(false);
      parity_loss(fsdp::call(model, local), local).backward();
      root.set_requires_gradient_sync(true);
      // Then a backward that fails in mid, after l3 reduced (or began to).
      model->mid->fail_backward = true;
      at::Tensor loss = parity_loss(fsdp::call(model, local), local);
      model->mid->fail_backward = false;
      expect_error([&] { loss.backward(); }, "injected backward failure");
      expect_error([&] { fsdp::call(model, local); }, "Call reset_iter_state() on the root FSDPModule");
      root.reset_iter_state();
      EXPECT_EQ(root.reductions_in_flight(), 0);
      for (const torch::nn::Module* m :
           std::initializer_list<const torch::nn::Module*>{model->l1.get(), model->mid.get(), model->l3.get()}) {
        EXPECT_EQ(fsdp::get_fsdp_module(*m).unsharded_parameter_bytes(), 0) << m->name();
      }
      return false;
    };
    expect_training_parity(reference.ptr(), model.ptr(), net_forward, "backward failure", o);
  });
}

// HSDP over 2 x 2 ranks: a micro-batch reduce-scattered without its all-reduce leaves partial
// sums in every group; a failed backward after it must not let them into the next step.
TEST(ResetIterState, DropsHsdpPartialSums) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    const auto opts = fsdp::FullyShardOptions().mesh(mesh);
    Net reference = make_net();
    Net model = make_net();
    fsdp::fully_shard(model->l1, opts);
    fsdp::fully_shard(model->mid, opts);
    fsdp::fully_shard(model->l3, opts);
    fsdp::FSDPModule root = fsdp::fully_shard(model, opts);
    ParityOptions o;
    o.steps = 4;
    o.before_step = [&](int step, const at::Tensor& local) {
      if (step != 1) return true;
      root.set_requires_all_reduce(false);
      parity_loss(fsdp::call(model, local), local).backward();
      root.set_requires_all_reduce(true);
      model->mid->fail_backward = true;
      at::Tensor loss = parity_loss(fsdp::call(model, local), local);
      model->mid->fail_backward = false;
      expect_error([&] { loss.backward(); }, "injected backward failure");
      root.reset_iter_state();
      return false;
    };
    expect_training_parity(reference.ptr(), model.ptr(), net_forward, "hsdp", o);
  });
}

// A reduce-scatter that has finished before it returns, so that FSDP sees it done at once.
struct FinishedOnReturn : fsdp::ReduceScatter {
  fsdp::WorkHandle operator()(const at::Tensor& output, const at::Tensor& input, fsdp::ProcessGroup& group,
                              fsdp::ReduceOp op) override {
    group.reduce_scatter_into(output, input, op)->wait();
    return nullptr;
  }
};

// HSDP starts a group's all-reduce once its reduce-scatter is seen finished, and each rank looks
// at its own moment. Here rank 0 sees l3's reduce-scatter finished at once (it starts l3's
// all-reduce) and rank 2 does not (its shard partner, rank 3, reaches l3 late), then both throw
// in mid. Unless reset_iter_state() issues what a rank had not started, the replicate group
// [0, 2] is one all-reduce out of step from then on.
TEST(ResetIterState, LeavesTheReplicateGroupsInStepWhateverEachRankHadStarted) {
  run_distributed(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    const auto opts = fsdp::FullyShardOptions().mesh(mesh);
    Net reference = make_net();
    Net model = make_net();
    fsdp::fully_shard(model->l1, opts);
    fsdp::fully_shard(model->mid, opts);
    fsdp::FSDPModule l3 = fsdp::fully_shard(model->l3, opts);
    fsdp::FSDPModule root = fsdp::fully_shard(model, opts);
    const int rank = fsdp::get_rank();
    ParityOptions o;
    o.steps = 4;
    o.before_step = [&](int step, const at::Tensor& local) {
      if (step != 1) return true;
      if (rank == 0) l3.set_custom_reduce_scatter(std::make_shared<FinishedOnReturn>());
      if (rank == 3) model->pause_before_l3_backward = std::chrono::milliseconds(300);
      model->mid->fail_backward = true;
      at::Tensor loss = parity_loss(fsdp::call(model, local), local);
      model->mid->fail_backward = false;
      model->pause_before_l3_backward = std::chrono::milliseconds(0);
      expect_error([&] { loss.backward(); }, "injected backward failure");
      root.reset_iter_state();
      if (rank == 0) l3.set_custom_reduce_scatter(nullptr);
      return false;
    };
    expect_training_parity(reference.ptr(), model.ptr(), net_forward, "hsdp, ranks at different points", o);
  });
}

TEST(ResetIterState, IsForTheRootOnly) {
  run_distributed(2, [] {
    Net model = make_net();
    fsdp::FSDPModule root = shard_net(model);
    at::Tensor x = at::ones({2, 5});
    parity_loss(fsdp::call(model, x), x).backward();
    expect_error([&] { fsdp::get_fsdp_module(*model->mid).reset_iter_state(); },
                 "reset_iter_state() must be called on the root FSDP module, but 'mid'");
    root.reset_iter_state();  // between iterations: harmless
    parity_loss(fsdp::call(model, x), x).backward();
  });
}

namespace {

struct StageImpl : torch::nn::Module {
  StageImpl(int64_t in, int64_t hidden, int64_t out) {
    a = register_module("a", torch::nn::Linear(in, hidden));
    b = register_module("b", torch::nn::Linear(hidden, out));
  }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(fsdp::call(b, at::relu(fsdp::call(a, x)))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Stage);

// Two pipeline stages; the module holding them is not an FSDP module, so each stage is a root.
struct TwoStagesImpl : torch::nn::Module {
  TwoStagesImpl() {
    first = register_module("first", Stage(5, 7, 4));
    second = register_module("second", Stage(4, 3, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return fsdp::call(second, fsdp::call(first, x)); }
  Stage first{nullptr}, second{nullptr};
};
TORCH_MODULE(TwoStages);

TwoStages make_two_stages() {
  torch::manual_seed(0);
  return TwoStages();
}

fsdp::FSDPModule shard_stage(Stage& stage) {
  fsdp::fully_shard(stage->a);
  fsdp::fully_shard(stage->b);
  return fsdp::fully_shard(stage);
}

at::Tensor two_stages_forward(torch::nn::Module& m, const at::Tensor& x) {
  return fsdp::call(dynamic_cast<TwoStagesImpl*>(&m), x);
}

}  // namespace

TEST(ShareCommCtx, TwoRootsTrainTogetherOnOneContext) {
  for (int world : {2, 3}) {
    run_distributed(world, [] {
      TwoStages reference = make_two_stages();
      TwoStages model = make_two_stages();
      fsdp::FSDPModule first = shard_stage(model->first);
      fsdp::FSDPModule second = shard_stage(model->second);
      fsdp::share_comm_ctx({});               // nothing to share
      fsdp::share_comm_ctx({first, second});  // before the first forward: adopted at lazy init
      // The first stage's first layer keeps its reduction pending until the end of the last
      // backward (a group with an all-reduce hook writes its gradients there).
      fsdp::get_fsdp_module(*model->first->a).set_all_reduce_hook([](at::Tensor&) {});
      ParityOptions o;
      o.steps = 4;
      // Two micro-batches per step, the first not the last backward.
      o.fsdp_loss = [&](torch::nn::Module& m, const at::Tensor& local) {
        at::Tensor x1 = local.slice(0, 0, 1), x2 = local.slice(0, 1, 2);
        first.set_is_last_backward(false);
        second.set_is_last_backward(false);
        at::Tensor l1 = 0.5 * parity_loss(two_stages_forward(m, x1), x1);
        l1.backward();
        // One queue of reductions: both roots see the same pending ones.
        EXPECT_GE(first.reductions_in_flight(), 1);
        EXPECT_EQ(first.reductions_in_flight(), second.reductions_in_flight());
        first.set_is_last_backward(true);
        second.set_is_last_backward(true);
        at::Tensor l2 = 0.5 * parity_loss(two_stages_forward(m, x2), x2);
        return l2 + l1.detach();  // the step's loss; backward runs through l2
      };
      expect_training_parity(reference.ptr(), model.ptr(), two_stages_forward, "shared comm context", o);
      EXPECT_EQ(first.reductions_in_flight(), 0);
      EXPECT_EQ(second.reductions_in_flight(), 0);
      // After lazy initialisation: a root again is fine, a non-root is refused at once.
      fsdp::share_comm_ctx({second, first});
      expect_error(
          [&] {
            fsdp::share_comm_ctx({first, fsdp::get_fsdp_module(*model->second->a)});
          },
          "FSDP module 'a' is not a root");
    });
  }
}

TEST(ShareCommCtx, ANonRootGivenBeforeTheFirstForwardIsRefusedThere) {
  run_distributed(2, [] {
    TwoStages model = make_two_stages();
    fsdp::FSDPModule first = shard_stage(model->first);
    shard_stage(model->second);
    fsdp::share_comm_ctx({first, fsdp::get_fsdp_module(*model->second->b)});
    expect_error([&] { fsdp::call(model, at::ones({2, 5})); }, "share_comm_ctx was given FSDP module 'b'");
  });
}

namespace {

// Delegates to the process group, counting calls, bytes and buffers.
struct CountingAllGather : fsdp::AllGather {
  int64_t calls = 0, input_bytes = 0, allocations = 0;
  at::Tensor allocate(int64_t numel, at::ScalarType dtype, c10::Device device) override {
    ++allocations;
    return fsdp::AllGather::allocate(numel, dtype, device);
  }
  fsdp::WorkHandle operator()(const at::Tensor& output, const at::Tensor& input, fsdp::ProcessGroup& group) override {
    ++calls;
    input_bytes += input.numel() * static_cast<int64_t>(input.element_size());
    EXPECT_EQ(output.numel(), input.numel() * group.size());
    return group.all_gather_into(output, input);
  }
};

struct CountingReduceScatter : fsdp::ReduceScatter {
  int64_t calls = 0, output_bytes = 0, allocations = 0;
  at::Tensor allocate(int64_t numel, at::ScalarType dtype, c10::Device device) override {
    ++allocations;
    return fsdp::ReduceScatter::allocate(numel, dtype, device);
  }
  fsdp::WorkHandle operator()(const at::Tensor& output, const at::Tensor& input, fsdp::ProcessGroup& group,
                              fsdp::ReduceOp op) override {
    ++calls;
    output_bytes += output.numel() * static_cast<int64_t>(output.element_size());
    EXPECT_EQ(input.numel(), output.numel() * group.size());
    return group.reduce_scatter_into(output, input, op);
  }
};

}  // namespace

TEST(CustomComm, CountingAllGatherAndReduceScatterOnOneModule) {
  for (int world : {2, 3}) {
    run_distributed(world, [] {
      Net reference = make_net();
      Net model = make_net();
      shard_net(model);
      auto all_gather = std::make_shared<CountingAllGather>();
      auto reduce_scatter = std::make_shared<CountingReduceScatter>();
      fsdp::FSDPModule mid = fsdp::get_fsdp_module(*model->mid);
      mid.set_custom_all_gather(all_gather);
      mid.set_custom_reduce_scatter(reduce_scatter);
      ParityOptions o;
      o.steps = 3;
      expect_training_parity(reference.ptr(), model.ptr(), net_forward, "custom comm", o);
      // mid (Linear(7, 7): ceil(7 / W) rows of 7 and as many bias entries per padded shard) is
      // gathered once in forward and once in backward, and reduce-scattered once, per step.
      const int64_t W = fsdp::world()->size();
      const int64_t shard_bytes = (7 + W - 1) / W * 8 * 4;
      EXPECT_EQ(all_gather->calls, 2 * o.steps);
      EXPECT_EQ(all_gather->input_bytes, 2 * o.steps * shard_bytes);
      EXPECT_EQ(all_gather->allocations, 2 * all_gather->calls);  // the input and the output
      EXPECT_EQ(reduce_scatter->calls, o.steps);
      EXPECT_EQ(reduce_scatter->output_bytes, o.steps * shard_bytes);
      EXPECT_EQ(reduce_scatter->allocations, 2 * reduce_scatter->calls);
    });
  }
}

TEST(CustomComm, AllocationFromTheProcessGroupIsNotSupportedByThisBackend) {
  run_distributed(2, [] {
    Net model = make_net();
    fsdp::FSDPModule root = shard_net(model);
    root.set_allocate_memory_from_process_group_for_comm(false);  // the default: accepted
    expect_error([&] { root.set_allocate_memory_from_process_group_for_comm(true); },
                 "is not supported by this backend");
    fsdp::FSDPModule mid = fsdp::get_fsdp_module(*model->mid);
    mid.set_custom_reduce_scatter(std::make_shared<CountingReduceScatter>());
    expect_error([&] { mid.set_allocate_memory_from_process_group_for_comm(true); },
                 "has a custom all-gather or reduce-scatter installed");
  });
}

TEST(CustomComm, CudaStreamAndMemoryControlsAreRefusedOnACpuMesh) {
  run_distributed(2, [] {
    Net model = make_net();
    fsdp::FSDPModule root = shard_net(model);
    const c10::Event event(c10::DeviceType::CPU);
    expect_error([&] { root.set_post_optim_event(event); }, "set_post_optim_event: not supported yet");
    expect_error([&] { root.set_symm_mem_for_comm(); }, "set_symm_mem_for_comm(\"NCCL\"): not supported");
    root.set_unshard_async_op(false);  // the default: accepted
    expect_error([&] { root.set_unshard_async_op(true); }, "set_unshard_async_op(true) is not supported on a CPU mesh");
    // The refusals change nothing: the model still trains.
    at::Tensor loss = fsdp::call(model, at::ones({2, 5})).sum();
    loss.backward();
  });
}

namespace {

struct WrongSizeAllGather : CountingAllGather {
  at::Tensor allocate(int64_t numel, at::ScalarType dtype, c10::Device) override {
    return at::empty({numel + 1}, at::TensorOptions().dtype(dtype));
  }
};

}  // namespace

TEST(CustomComm, ABufferOfTheWrongSizeIsNamed) {
  run_distributed(2, [] {
    Net model = make_net();
    shard_net(model);
    fsdp::get_fsdp_module(*model->l3).set_custom_all_gather(std::make_shared<WrongSizeAllGather>());
    expect_error(
        [&] {
          fsdp::call(model, at::ones({2, 5}));
        },
        "the custom all-gather's allocate(16, Float, cpu) must return a contiguous 1-D tensor");
  });
}
