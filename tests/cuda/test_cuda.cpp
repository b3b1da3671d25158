// The CUDA path: NCCL at W=1, Gloo with CUDA tensors staged through host memory at W=2..4 (the
// GPU machine has one GPU, and NCCL refuses two ranks on one GPU), and fully_shard on a "cuda"
// mesh against one process and against the CPU path. Without a GPU, or in a build without the
// CUDA path, each reports skipped with the reason; the refusals run everywhere.
#include "cuda/cuda_testing.h"
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint_activations.h>
#include <fsdp/clip_grad.h>
#include <fsdp/device.h>
#include <fsdp/device_state_adamw.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/grad_scaler.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

using fsdp::testing::DistOptions;
using fsdp::testing::kGpu;
using fsdp::testing::run_distributed;
using fsdp::testing::sharded;
using fsdp::testing::staged_through_host;
using fsdp::testing::tiny_transformer;

namespace {

// The same tokens on every device: made on the CPU from the step and the rank.
at::Tensor loss_of(fsdp::models::Transformer& model, int64_t step, c10::Device device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step + 1000 * fsdp::get_rank());
  at::Tensor toks = at::randint(0, 8, {2, 16}, gen).to(device);
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}).to(at::kFloat), toks.roll(-1, 1).reshape({-1}));
}

std::vector<double> train(fsdp::models::Transformer& model, c10::Device device, int steps = 3) {
  torch::optim::Adam opt(model->parameters(), 1e-2);
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    opt.zero_grad();
    at::Tensor loss = loss_of(model, step, device);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rtol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], rtol * std::abs(b[i])) << "step " << i;
}

}  // namespace

TEST(Cuda, ACudaMeshWithoutAGpuIsRefusedWithTheReason) {
  if (fsdp::cuda_available()) GTEST_SKIP() << "this machine has a GPU: the refusal cannot happen here";
  run_distributed(1, [] {
    try {
      fsdp::init_device_mesh("cuda", {1});
      FAIL() << "a \"cuda\" mesh without a GPU was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(fsdp::cuda_unavailable_reason()), std::string::npos) << e.what();
    }
  });
}

TEST(Cuda, TheWorldStaysOnACpuBackendAndSaysWhereNcclGoes) {
  try {
    fsdp::init_process_group(fsdp::rendezvous_info_from_env(), fsdp::InitOptions().backend("nccl"));
    fsdp::destroy_process_group();
    FAIL() << "backend nccl was accepted for the world group";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("init_device_mesh(\"cuda\""), std::string::npos) << e.what();
  }
}

TEST(Cuda, AnNcclGroupWithoutTheCudaPathNamesTheBuildOption) {
  if (fsdp::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA path";
  run_distributed(1, [] {
    try {
      fsdp::new_group({0}, "nccl");
      FAIL() << "an NCCL group was made by a build without the CUDA path";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("-DFSDP_USE_CUDA=ON"), std::string::npos) << e.what();
    }
  });
}

TEST(Cuda, NcclCollectivesOnOneRank) {
  SKIP_WITHOUT_GPU();
  run_distributed(1, [] {
    auto mesh = fsdp::init_device_mesh("cuda", {1});
    auto pg = mesh.get_group(0);
    EXPECT_STREQ(pg->backend_name(), "nccl");
    const auto opts = at::TensorOptions().device(mesh.device());
    at::Tensor x = at::arange(6, opts.dtype(at::kFloat));
    at::Tensor out = at::empty({6}, x.options());
    pg->all_gather_into(out, x)->wait();
    EXPECT_TRUE(out.equal(x));
    at::Tensor rs = at::empty({6}, x.options());
    pg->reduce_scatter_into(rs, x, fsdp::ReduceOp::kAvg)->wait();
    EXPECT_TRUE(rs.equal(x));
    at::Tensor v = at::empty({6}, x.options());
    pg->all_gather_v(v, x, {6})->wait();
    EXPECT_TRUE(v.equal(x));
    at::Tensor y = x.clone();
    pg->all_reduce(y, fsdp::ReduceOp::kSum)->wait();
    pg->broadcast(y, 0)->wait();
    pg->barrier()->wait();
    EXPECT_TRUE(y.cpu().equal(x.cpu()));
  });
}

TEST(Cuda, GlooStagesCudaTensorsThroughTheHostForRanksSharingAGpu) {
  SKIP_WITHOUT_GPU();
  for (int world : {2, 3, 4}) {
    run_distributed(
        world,
        [] {
          auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          auto pg = mesh.get_group(0);
          const int w = pg->size(), r = pg->rank();
          const auto opts = at::TensorOptions().device(mesh.device()).dtype(at::kFloat);
          at::Tensor mine = at::full({3}, static_cast<double>(r), opts);
          at::Tensor all = at::empty({3 * w}, opts);
          pg->all_gather_into(all, mine)->wait();
          for (int q = 0; q < w; ++q) EXPECT_EQ(all[3 * q].item<float>(), static_cast<float>(q));
          at::Tensor in = at::ones({3 * w}, opts);
          at::Tensor shard = at::empty({3}, opts);
          pg->reduce_scatter_into(shard, in)->wait();
          EXPECT_TRUE(shard.cpu().equal(at::full({3}, static_cast<double>(w))));
          at::Tensor t = at::full({5}, static_cast<double>(r + 1), opts);
          pg->all_reduce(t)->wait();
          EXPECT_EQ(t[0].item<float>(), static_cast<float>(w * (w + 1) / 2));
          EXPECT_TRUE(t.is_cuda());
        },
        staged_through_host());
  }
}

TEST(Cuda, FullyShardOnOneGpuTrainsLikeTheUnshardedModel) {
  SKIP_WITHOUT_GPU();
  run_distributed(1, [] {
    auto mesh = fsdp::init_device_mesh("cuda", {1});
    auto model = sharded(mesh);
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_cuda());
    auto reference = tiny_transformer();
    reference->to(kGpu);
    expect_close(train(model, kGpu), train(reference, kGpu), 1e-5);
  });
}

TEST(Cuda, FullyShardOnSharedGpuMatchesTheCpuPath) {
  SKIP_WITHOUT_GPU();
  for (int world : {2, 3}) {
    run_distributed(
        world,
        [] {
          auto gpu_mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          auto cpu_mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()});
          auto on_gpu = sharded(gpu_mesh);
          auto on_cpu = sharded(cpu_mesh);
          expect_close(train(on_gpu, kGpu), train(on_cpu, c10::Device(c10::DeviceType::CPU)), 1e-4);
        },
        staged_through_host());
  }
}

TEST(Cuda, Bf16ComputeWithFp32ReductionStaysNearFp32) {
  SKIP_WITHOUT_GPU();
  run_distributed(1, [] {
    auto mesh = fsdp::init_device_mesh("cuda", {1});
    auto bf16 = sharded(mesh, fsdp::FullyShardOptions().mp_policy(
                                  fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)));
    auto fp32 = sharded(mesh);
    expect_close(train(bf16, kGpu), train(fp32, kGpu), 3e-2);
  });
}

TEST(Cuda, PinnedCpuOffloadKeepsShardsOnTheHostAndTrainsLikeNoOffload) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    run_distributed(
        world,
        [] {
          auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          auto offloaded = sharded(mesh, fsdp::FullyShardOptions().offload_policy(fsdp::CPUOffloadPolicy()));
          auto plain = sharded(mesh);
          for (const auto& p : offloaded->parameters()) {
            EXPECT_TRUE(p.is_cpu());
            EXPECT_TRUE(p.is_pinned());
          }
          expect_close(train(offloaded, kGpu), train(plain, kGpu), 1e-5);
          for (const auto& p : offloaded->parameters()) EXPECT_TRUE(p.grad().is_cpu());
        },
        staged_through_host());
  }
}

TEST(Cuda, PeakDeviceMemoryIsTheSameEveryIteration) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    run_distributed(
        world,
        [] {
          auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          auto model = sharded(mesh);
          torch::optim::Adam opt(model->parameters(), 1e-2);
          std::vector<int64_t> peaks;
          for (int64_t step = 0; step < 5; ++step) {
            fsdp::reset_peak_device_memory(kGpu);
            opt.zero_grad(true);
            loss_of(model, step, kGpu).backward();
            opt.step();
            peaks.push_back(fsdp::device_memory_stats(kGpu).max_allocated_bytes);
          }
          // The first iterations create the optimizer state; from the third on, nothing changes.
          EXPECT_EQ(peaks[2], peaks[3]);
          EXPECT_EQ(peaks[3], peaks[4]);
        },
        staged_through_host());
  }
}

// fp16 with loss scaling on GPU gradients: unscale_ goes through ATen's fused kernel, the verdict
// through the mesh's group (NCCL at W=1, Gloo-staged at W=2), and an inf on one rank skips the
// step on every rank. The global norm of GPU gradients is the same as on the host.
TEST(Cuda, GradScalerUnscalesGpuGradientsAndEveryRankSkipsAnOverflow) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    run_distributed(
        world,
        [] {
          auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          auto model = sharded(mesh, fsdp::FullyShardOptions().mp_policy(
                                         fsdp::MixedPrecisionPolicy().param_dtype(at::kHalf).reduce_dtype(at::kFloat)));
          torch::optim::Adam opt(model->parameters(), 1e-2);
          fsdp::GradScaler scaler(fsdp::GradScalerOptions().init_scale(1024.0).process_group(mesh.get_group(0)));
          scaler.scale(loss_of(model, 0, kGpu)).backward();
          std::vector<at::Tensor> scaled;
          for (const auto& p : model->parameters()) scaled.push_back(p.grad().clone());
          const double scaled_norm = fsdp::clip_grad_norm_(model->parameters(), INFINITY);
          scaler.unscale_(opt);
          size_t i = 0;
          for (const auto& p : model->parameters()) {
            EXPECT_TRUE(p.grad().is_cuda());
            EXPECT_TRUE(at::allclose(p.grad() * 1024.0, scaled[i++], 1e-5, 1e-6));
          }
          EXPECT_NEAR(fsdp::clip_grad_norm_(model->parameters(), INFINITY), scaled_norm / 1024.0,
                      1e-4 * scaled_norm / 1024.0);
          EXPECT_TRUE(scaler.step(opt));
          scaler.update();
          // An overflow on the last rank only: every rank skips and backs off.
          opt.zero_grad();
          scaler.scale(loss_of(model, 1, kGpu)).backward();
          if (fsdp::get_rank() == fsdp::get_world_size() - 1) model->parameters()[0].mutable_grad().fill_(INFINITY);
          EXPECT_FALSE(scaler.step(opt));
          scaler.update();
          EXPECT_EQ(scaler.get_scale(), 512.0);
        },
        staged_through_host());
  }
}

// Dropout on the GPU inside a checkpoint: the recomputation draws the forward's mask from the
// GPU's generator, so the gradients are those of the plain forward, and the generator is put back.
TEST(Cuda, CheckpointReplaysTheGpuGeneratorInTheRecomputation) {
  SKIP_WITHOUT_GPU();
  auto fn = [](const at::Tensor& x) { return at::dropout(x * 2.0, 0.5, /*train=*/true); };
  const at::Tensor input = at::randn({4096}, at::TensorOptions().device(kGpu));
  auto grad_of = [&](bool checkpointed) {
    at::Tensor x = input.clone().requires_grad_(true);
    torch::manual_seed(7);
    at::Tensor y = checkpointed ? fsdp::checkpoint(fn, x) : fn(x);
    y.sum().backward();
    return std::make_pair(x.grad(), at::rand({4}, input.options()));  // where the generator went on
  };
  const auto plain = grad_of(false);
  const auto checkpointed = grad_of(true);
  EXPECT_TRUE(plain.first.equal(checkpointed.first));
  EXPECT_TRUE(plain.second.equal(checkpointed.second));
}

// Parameters and gradients in pinned host memory, AdamW's state on the GPU: the trajectory is
// full offload's (state in host memory too), and the state stays on the GPU.
TEST(Cuda, DeviceStateAdamWKeepsTheStateOnTheGpuAndTrainsLikeFullOffload) {
  SKIP_WITHOUT_GPU();
  for (int world : {1, 2}) {
    run_distributed(
        world,
        [] {
          auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          const auto offload = fsdp::FullyShardOptions().offload_policy(fsdp::CPUOffloadPolicy());
          auto split = sharded(mesh, offload);
          auto full = sharded(mesh, offload);
          const auto options = torch::optim::AdamWOptions(1e-2);
          fsdp::optim::DeviceStateAdamW split_opt(split->parameters(), options, mesh.device());
          torch::optim::AdamW full_opt(full->parameters(), options);
          for (int64_t step = 0; step < 3; ++step) {
            for (auto* opt : std::vector<torch::optim::Optimizer*>{&split_opt, &full_opt}) opt->zero_grad();
            loss_of(split, step, kGpu).backward();
            loss_of(full, step, kGpu).backward();
            split_opt.step();
            full_opt.step();
          }
          auto full_params = full->parameters();
          size_t i = 0;
          for (const auto& p : split->parameters()) {
            EXPECT_TRUE(p.is_cpu() && p.is_pinned());
            EXPECT_TRUE(at::allclose(p, full_params[i++], 1e-5, 1e-6));
          }
          for (const auto& entry : split_opt.state()) {
            EXPECT_TRUE(static_cast<torch::optim::AdamWParamState&>(*entry.second).exp_avg().is_cuda());
          }
        },
        staged_through_host());
  }
}

// module->to(dtype) after fully_shard re-lays the shards on the GPU and trains like the CPU path
// converted alike; to(kCPU) takes them off the mesh's device, where the next forward refuses them
// by name, and to(the GPU) brings them back; offloaded shards are re-laid in pinned host memory,
// and moving them to the GPU is refused as FSDP2 refuses it.
TEST(Cuda, ToDtypeAndToDeviceAfterFullyShard) {
  SKIP_WITHOUT_GPU();
  const c10::Device host(c10::DeviceType::CPU);
  auto expect_refused = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "expected an error containing '" << part << "'";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  for (int world : {1, 2}) {
    run_distributed(
        world,
        [&] {
          auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
          auto on_gpu = sharded(mesh);
          auto on_cpu = sharded(fsdp::init_device_mesh("cpu", {fsdp::get_world_size()}));
          on_gpu->to(at::kDouble);
          on_cpu->to(at::kDouble);
          expect_close(train(on_gpu, kGpu), train(on_cpu, host), 1e-9);
          for (const auto& p : on_gpu->parameters()) {
            EXPECT_TRUE(p.is_cuda());
            EXPECT_EQ(p.scalar_type(), at::kDouble);
            EXPECT_EQ(p.grad().scalar_type(), at::kDouble);
          }
          on_gpu->to(host);
          expect_refused([&] { loss_of(on_gpu, 0, host); }, "must be on the mesh's device cuda:0");
          fsdp::get_fsdp_module(*on_gpu).reset_iter_state();
          on_gpu->to(kGpu);
          expect_close(train(on_gpu, kGpu, 2), train(on_cpu, host, 2), 1e-9);

          auto offloaded = sharded(mesh, fsdp::FullyShardOptions().offload_policy(fsdp::CPUOffloadPolicy()));
          offloaded->to(at::kDouble);
          train(offloaded, kGpu, 1);
          for (const auto& p : offloaded->parameters()) {
            EXPECT_TRUE(p.is_cpu() && p.is_pinned());
            EXPECT_EQ(p.scalar_type(), at::kDouble);
          }
          offloaded->to(kGpu);
          expect_refused([&] { loss_of(offloaded, 0, kGpu); }, "should be materialized on CPU");
        },
        staged_through_host());
  }
}
