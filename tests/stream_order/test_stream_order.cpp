// The stream-order checker (src/device/stream_check.h): first that it sees each kind of missing
// wait, then FSDP's matrix trained under it, which must leave no report. Every test body runs in
// processes started with FSDP_DEVICE_CHECK=1 (the mode is chosen when libfsdp loads), so that the
// CPU device has streams, events, host memory and the checks a GPU would need.
#include "harness/multiprocess.h"

#include "src/device/device_ops.h"
#include "src/device/stream_check.h"

#include <fsdp/call.h>
#include <fsdp/device_state_adamw.h>
#include <fsdp/distributed.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/parallelize.h>
#include <fsdp/models/transformer.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

using fsdp::testing::DistOptions;
using fsdp::testing::run_distributed;
namespace check = fsdp::device::stream_check;

namespace {

const c10::Device kCpu(c10::DeviceType::CPU);

DistOptions checked() {
  DistOptions o;
  o.env["FSDP_DEVICE_CHECK"] = "1";
  return o;
}

std::string joined(const std::vector<std::string>& reports) {
  std::string s;
  for (const auto& r : reports) s += "\n  - " + r;
  return s;
}

// The one report there is, which must name each of `parts`.
void expect_one_report_naming(const std::vector<std::string>& parts) {
  const auto reports = check::reports();
  ASSERT_EQ(reports.size(), 1u) << joined(reports);
  for (const auto& part : parts)
    EXPECT_NE(reports[0].find(part), std::string::npos) << part << " in" << joined(reports);
  check::clear_reports();
}

void expect_no_reports() {
  const auto reports = check::reports();
  EXPECT_TRUE(reports.empty()) << reports.size() << " stream-order report(s):" << joined(reports);
}

fsdp::device::DeviceOps& cpu_ops() { return fsdp::device::ops_for(c10::DeviceType::CPU); }

}  // namespace

// ------------------------------------------------------------------ the checker sees each kind

TEST(StreamCheck, IsOnOnlyWhenAskedFor) {
  if (!fsdp::testing::is_child()) {  // this process was started without FSDP_DEVICE_CHECK
    EXPECT_FALSE(check::enabled());
    EXPECT_FALSE(cpu_ops().has_streams());
  }
  run_distributed(
      1,
      [] {
        EXPECT_TRUE(check::enabled());
        EXPECT_TRUE(cpu_ops().has_streams());
        EXPECT_TRUE(cpu_ops().can_pin_host_memory());
      },
      checked());
}

TEST(StreamCheck, AReadOfAnotherStreamsWriteWithoutAWaitIsReported) {
  run_distributed(
      1,
      [] {
        auto& ops = cpu_ops();
        const c10::Stream compute = ops.current_stream(kCpu);
        const c10::Stream side = ops.side_stream(kCpu, true);
        check::label_stream(side, "the test's side stream");
        at::Tensor x = at::zeros({4});
        check::label(x, "x");
        ops.wait(side, ops.record(compute));
        {
          fsdp::device::StreamScope scope(side);
          x.fill_(1);
        }
        check::clear_reports();
        at::Tensor y = x * 2;
        expect_one_report_naming({"aten::mul on the compute stream reads 'x'", "aten::fill_ on the test's side stream",
                                  "record an event on the test's side stream"});
        ops.wait(compute, ops.record(side));
        at::Tensor z = x * 2;
        expect_no_reports();
      },
      checked());
}

TEST(StreamCheck, AFreeBeforeTheAllocatingStreamWaitedIsReported) {
  run_distributed(
      1,
      [] {
        auto& ops = cpu_ops();
        const c10::Stream compute = ops.current_stream(kCpu);
        const c10::Stream side = ops.side_stream(kCpu, false);
        check::label_stream(side, "the copy stream");
        for (bool wait_before_free : {false, true}) {
          at::Tensor x = at::ones({1024});
          check::label(x, "the staging buffer");
          ops.wait(side, ops.record(compute));
          at::Tensor copied = at::empty({1024});
          {
            fsdp::device::StreamScope scope(side);
            copied.copy_(x);
          }
          if (wait_before_free) ops.wait(compute, ops.record(side));
          check::clear_reports();
          x = at::Tensor();
          at::Tensor next = at::empty({1024});  // may take x's block on a GPU
          if (wait_before_free) {
            expect_no_reports();
          } else {
            expect_one_report_naming({"'the staging buffer' was freed while aten::copy_ on the copy stream",
                                      "the compute stream, where it was allocated, allocated again (aten::empty)"});
          }
          ops.wait(compute, ops.record(side));
        }
      },
      checked());
}

TEST(StreamCheck, TheHostReadingACopyToHostMemoryBeforeItLandedIsReported) {
  run_distributed(
      1,
      [] {
        auto& ops = cpu_ops();
        at::Tensor d = at::ones({8});
        at::Tensor h = ops.to_host(d, at::kFloat, /*pinned=*/true, /*non_blocking=*/true);
        check::label(h, "the offloaded gradient");
        h.add_(1);
        expect_one_report_naming(
            {"the host writes pinned host memory 'the offloaded gradient'", "aten::copy_ on the compute stream"});
        at::Tensor h2 = ops.to_host(d, at::kFloat, true, true);
        ops.synchronize(ops.record(ops.current_stream(kCpu)));
        h2.add_(1);
        at::Tensor h3 = ops.to_host(d, at::kFloat, true, /*non_blocking=*/false);
        h3.add_(1);
        at::Tensor pageable = ops.to_host(d, at::kFloat, /*pinned=*/false, /*non_blocking=*/true);
        pageable.add_(1);  // a copy into pageable memory is synchronous
        expect_no_reports();
      },
      checked());
}

TEST(StreamCheck, AKernelMixingHostAndDeviceMemoryIsReported) {
  run_distributed(
      1,
      [] {
        auto& ops = cpu_ops();
        at::Tensor d = at::ones({8});
        at::Tensor h = ops.to_host(d, at::kFloat, true, false);
        check::label(h, "the host copy");
        at::Tensor sum = d + h;
        expect_one_report_naming(
            {"aten::add on the compute stream mixes host memory (pinned host memory 'the host copy') with device "
             "memory"});
        at::Tensor back = ops.to_device(h, kCpu, at::kFloat, true);
        at::Tensor ok = d + back;
        expect_no_reports();
      },
      checked());
}

TEST(StreamCheck, ACollectivesOutputIsReadyOnlyAfterItsWait) {
  run_distributed(
      2,
      [] {
        auto pg = fsdp::world();
        at::Tensor in = at::full({3}, static_cast<double>(pg->rank()));
        at::Tensor out = at::empty({6});
        check::label(out, "the gathered rows");
        auto work = pg->all_gather_into(out, in);
        work->wait();
        at::Tensor total = out.sum();
        expect_no_reports();
        at::Tensor early = at::empty({6});
        check::label(early, "rows read early");
        auto second = pg->all_gather_into(early, in);
        second->wait();  // the host has them; the compute stream is told to wait by this wait()
        const auto side = cpu_ops().side_stream(kCpu, true);
        auto third = pg->all_gather_into(early, in);
        {
          fsdp::device::StreamScope scope(side);
          third->wait();  // the side stream waits, not the compute stream
        }
        at::Tensor read = early.sum();
        expect_one_report_naming(
            {"aten::sum on the compute stream reads 'rows read early'", "the all_gather on group"});
      },
      checked());
}

// ------------------------------------------------------------------ FSDP's matrix under the checker

namespace {

fsdp::models::ModelArgs tiny_args() {
  fsdp::models::ModelArgs args;
  args.dropout_p = 0.0;
  return args;
}

fsdp::models::Transformer seeded_model(const fsdp::models::ModelArgs& args = tiny_args()) {
  torch::manual_seed(0);
  return fsdp::models::Transformer(args);
}

// The blocks' FSDP modules, then the root's.
std::vector<fsdp::FSDPModule> shard_blocks_and_root(fsdp::models::Transformer& model,
                                                    const fsdp::FullyShardOptions& opts) {
  std::vector<fsdp::FSDPModule> modules;
  for (auto& block : model->blocks()) modules.push_back(fsdp::fully_shard(block, opts));
  modules.push_back(fsdp::fully_shard(model, opts));
  return modules;
}

at::Tensor tokens(int64_t step, int64_t salt) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step + 1000 * salt);
  return at::randint(0, 8, {2, 16}, gen);
}

at::Tensor loss_of(fsdp::models::Transformer& model, const at::Tensor& toks) {
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat),
                                              toks.roll(-1, 1).reshape({-1}));
}

using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(fsdp::models::Transformer&)>;

std::unique_ptr<torch::optim::Optimizer> adamw(fsdp::models::Transformer& model) {
  return std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
}

struct TrainingRun {
  int steps = 3;
  int micro_batches = 1;      // > 1: gradient accumulation, the sync only on the last
  bool partial_sums = false;  // with micro_batches > 1 under HSDP: reduce-scatter every one, all-reduce the last
  int64_t data_salt = -1;     // tokens per rank by default; set for ranks that must share a batch (tp)
  MakeOptimizer optimizer = adamw;
};

// Trains `model` as a user would and leaves the checker's verdict: no report, finite losses.
// The losses are read after the optimizer step (as a loop that logs them now and then does),
// so that no read of a loss synchronizes the host with the streams before the step.
void train_under_the_checker(fsdp::models::Transformer& model, const std::vector<fsdp::FSDPModule>& modules,
                             const TrainingRun& run = TrainingRun()) {
  auto opt = run.optimizer(model);
  fsdp::FSDPModule root = modules.back();
  const int64_t salt = run.data_salt >= 0 ? run.data_salt : fsdp::get_rank();
  for (int step = 0; step < run.steps; ++step) {
    opt->zero_grad();
    std::vector<at::Tensor> losses;
    for (int micro = 0; micro < run.micro_batches; ++micro) {
      const bool last = micro == run.micro_batches - 1;
      if (run.micro_batches > 1 && run.partial_sums) root.set_requires_all_reduce(last);
      if (run.micro_batches > 1 && !run.partial_sums) root.set_requires_gradient_sync(last);
      at::Tensor loss = loss_of(model, tokens(step * run.micro_batches + micro, salt));
      loss.backward();
      losses.push_back(loss.detach());
    }
    opt->step();
    for (const at::Tensor& loss : losses) EXPECT_TRUE(std::isfinite(loss.item<double>())) << "step " << step;
  }
  expect_no_reports();
}

void under_the_checker(int world, const std::function<void()>& body) { run_distributed(world, body, checked()); }

fsdp::DeviceMesh mesh_1d() { return fsdp::init_device_mesh("cpu", {fsdp::get_world_size()}); }

}  // namespace

TEST(StreamOrder, FullShard) {
  under_the_checker(2, [] {
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh_1d()));
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, ShardGradOp) {
  under_the_checker(2, [] {
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh_1d()).reshard_after_forward(false));
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, ReshardAfterForwardToTwoOfFourRanks) {
  under_the_checker(4, [] {
    auto model = seeded_model();
    auto opts = fsdp::FullyShardOptions().mesh(mesh_1d());
    std::vector<fsdp::FSDPModule> modules;
    for (auto& block : model->blocks()) {
      modules.push_back(fsdp::fully_shard(block, fsdp::FullyShardOptions(opts).reshard_after_forward(2)));
    }
    modules.push_back(fsdp::fully_shard(model, opts));
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, Hsdp) {
  under_the_checker(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh));
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, HsdpWithGradientAccumulation) {
  under_the_checker(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh));
    TrainingRun run;
    run.micro_batches = 2;
    train_under_the_checker(model, modules, run);
  });
}

// Each micro-batch's reduce-scatter output is summed on the reduce-scatter stream; the last
// one's all-reduce reads the sum on the all-reduce stream.
TEST(StreamOrder, HsdpWithPartialSumsOverMicroBatches) {
  under_the_checker(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh));
    TrainingRun run;
    run.micro_batches = 2;
    run.partial_sums = true;
    train_under_the_checker(model, modules, run);
  });
}

// The all-reduce's buffer is copied to host memory and dropped: its memory must not be reused
// while the all-reduce stream may still use it.
TEST(StreamOrder, HsdpWithCpuOffload) {
  under_the_checker(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
    auto model = seeded_model();
    auto modules =
        shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh).offload_policy(fsdp::CPUOffloadPolicy()));
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, ExplicitPrefetch) {
  under_the_checker(2, [] {
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh_1d()));
    const size_t blocks = modules.size() - 1;
    for (size_t i = 0; i + 1 < blocks; ++i) modules[i].set_modules_to_forward_prefetch({modules[i + 1]});
    for (size_t i = 1; i < blocks; ++i) modules[i].set_modules_to_backward_prefetch({modules[i - 1]});
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, GradientAccumulation) {
  under_the_checker(2, [] {
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh_1d()));
    TrainingRun run;
    run.micro_batches = 3;
    train_under_the_checker(model, modules, run);
  });
}

TEST(StreamOrder, MixedPrecision) {
  under_the_checker(2, [] {
    auto model = seeded_model();
    const auto mp = fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
    auto modules = shard_blocks_and_root(model, fsdp::FullyShardOptions().mesh(mesh_1d()).mp_policy(mp));
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, CpuOffloadOnOneRank) {
  under_the_checker(1, [] {
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(
        model, fsdp::FullyShardOptions().mesh(mesh_1d()).offload_policy(fsdp::CPUOffloadPolicy()));
    train_under_the_checker(model, modules);
  });
}

TEST(StreamOrder, CpuOffloadOnOneRankWithMixedPrecision) {
  under_the_checker(1, [] {
    auto model = seeded_model();
    const auto mp = fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16);
    auto modules = shard_blocks_and_root(
        model, fsdp::FullyShardOptions().mesh(mesh_1d()).mp_policy(mp).offload_policy(fsdp::CPUOffloadPolicy()));
    TrainingRun run;
    run.micro_batches = 2;
    train_under_the_checker(model, modules, run);
  });
}

TEST(StreamOrder, CpuOffloadOnTwoRanks) {
  under_the_checker(2, [] {
    auto model = seeded_model();
    auto modules = shard_blocks_and_root(
        model, fsdp::FullyShardOptions().mesh(mesh_1d()).offload_policy(fsdp::CPUOffloadPolicy()));
    TrainingRun run;
    run.micro_batches = 2;
    train_under_the_checker(model, modules, run);
  });
}

// module->to(dtype) between iterations: the shards are re-laid on the compute stream at the next
// unshard, after the side streams' wait of the root's pre-forward (device shards, and pinned host
// shards under CPU offload).
TEST(StreamOrder, ToDtypeBetweenIterations) {
  for (bool offload : {false, true}) {
    under_the_checker(2, [offload] {
      auto model = seeded_model();
      auto opts = fsdp::FullyShardOptions().mesh(mesh_1d());
      if (offload) opts.offload_policy(fsdp::CPUOffloadPolicy());
      auto modules = shard_blocks_and_root(model, opts);
      TrainingRun run;
      run.steps = 1;
      train_under_the_checker(model, modules, run);
      model->to(at::kDouble);
      run.steps = 2;
      train_under_the_checker(model, modules, run);
    });
  }
}

TEST(StreamOrder, DeviceStateAdamW) {
  for (int world : {1, 2}) {
    under_the_checker(world, [] {
      auto model = seeded_model();
      auto modules = shard_blocks_and_root(
          model, fsdp::FullyShardOptions().mesh(mesh_1d()).offload_policy(fsdp::CPUOffloadPolicy()));
      TrainingRun run;
      run.optimizer = [](fsdp::models::Transformer& m) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<fsdp::optim::DeviceStateAdamW>(m->parameters(), torch::optim::AdamWOptions(1e-2), kCpu);
      };
      train_under_the_checker(model, modules, run);
    });
  }
}

TEST(StreamOrder, TensorParallelUnderFsdp) {
  under_the_checker(4, [] {
    auto mesh = fsdp::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
    fsdp::models::ModelArgs args = tiny_args();
    auto model = seeded_model(args);
    fsdp::models::parallelize(model, fsdp::tp::TensorParallelMesh(mesh, "tp"));
    const auto opts = fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(fsdp::DataParallelMeshDims().shard("dp"));
    auto modules = shard_blocks_and_root(model, opts);
    TrainingRun run;
    run.data_salt = mesh.get_local_rank(0);  // the tp ranks of one dp rank see the same batch
    train_under_the_checker(model, modules, run);
  });
}
