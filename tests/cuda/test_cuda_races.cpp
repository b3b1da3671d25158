// The CUDA path's stream ordering, provoked as FSDP2's tests provoke it with torch.cuda._sleep:
// FSDP_CUDA_SIDE_STREAM_DELAY_CYCLES (src/device/cuda_device_ops.cpp) makes every side stream
// spin on the GPU each time it becomes current, so work issued there lands late, and a stream or
// the host that reads it without waiting reads stale or unwritten memory every time rather than
// under unlucky timing. The knob is read once per process, so each test trains twice, in two sets
// of processes: first without the delay (and the same training on the CPU path), each rank saving
// its losses and parameter shards; then with it, each rank comparing its own against both.
// Without a GPU, or in a build without the CUDA path, each test reports skipped with the reason,
// unless FSDP_RACE_TESTS_ON_CPU=1 (scripts/gpu-check.sh --cpu, its rehearsal without a GPU): then
// the "GPU" runs use a cpu mesh, which checks the tests' own plumbing (processes, files,
// comparisons) and nothing about streams.
#include "harness/multiprocess.h"

#include <fsdp/call.h>
#include <fsdp/device.h>
#include <fsdp/device_state_adamw.h>
#include <fsdp/distributed.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using fsdp::testing::DistOptions;
using fsdp::testing::is_child;
using fsdp::testing::run_distributed;

namespace {

bool stand_in_on_cpu() {
  const char* v = std::getenv("FSDP_RACE_TESTS_ON_CPU");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

}  // namespace

#define SKIP_WITHOUT_GPU()                                                     \
  do {                                                                         \
    if (!stand_in_on_cpu() && !fsdp::cuda_available())                         \
      GTEST_SKIP() << "needs a CUDA GPU: " << fsdp::cuda_unavailable_reason(); \
  } while (0)

namespace {

// About 12 ms of an H100's SM clock each time a side stream becomes current: far longer than any
// host work between an issue and its use in these tiny models.
constexpr const char* kDelayCycles = "20000000";
constexpr int kSteps = 3;

// One training configuration: the mesh, the policies, and what is set on the FSDP modules.
struct RaceCase {
  std::string name;
  std::vector<int64_t> mesh_shape;  // {W}, or {replicas, shards} for HSDP
  bool bf16 = false;                // param_dtype bf16, reduce_dtype fp32
  bool offload = false;             // CPUOffloadPolicy() on the GPU (none on the CPU path: same math)
  double divide_factor = 0.0;       // > 0: set_gradient_divide_factor on every FSDP module
  bool explicit_prefetch = false;   // each block prefetches the next in forward, the previous in backward
  bool device_state_adamw = false;  // AdamW on the GPU for offloaded shards (AdamW on the CPU path)
  int world() const {
    int w = 1;
    for (int64_t d : mesh_shape) w *= static_cast<int>(d);
    return w;
  }
};

struct Trained {
  std::vector<double> losses;
  std::vector<at::Tensor> params;  // this rank's shards, fp32 on the CPU
};

fsdp::DeviceMesh mesh_for(const RaceCase& c, const std::string& device_type) {
  if (c.mesh_shape.size() == 2) return fsdp::init_device_mesh(device_type, c.mesh_shape, {"replicate", "shard"});
  return fsdp::init_device_mesh(device_type, c.mesh_shape);
}

fsdp::models::Transformer build(const RaceCase& c, const fsdp::DeviceMesh& mesh, bool on_gpu) {
  torch::manual_seed(0);
  fsdp::models::ModelArgs args;
  args.dropout_p = 0.0;
  fsdp::models::Transformer model(args);
  auto opts = fsdp::FullyShardOptions().mesh(mesh);
  if (c.bf16) opts.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  if (c.offload && on_gpu) opts.offload_policy(fsdp::CPUOffloadPolicy().pin_memory(!mesh.device().is_cpu()));
  std::vector<fsdp::FSDPModule> blocks;
  for (auto& block : model->blocks()) blocks.push_back(fsdp::fully_shard(block, opts));
  fsdp::FSDPModule root = fsdp::fully_shard(model, opts);
  if (c.divide_factor > 0) {
    for (auto& m : blocks) m.set_gradient_divide_factor(c.divide_factor);
    root.set_gradient_divide_factor(c.divide_factor);
  }
  if (c.explicit_prefetch) {
    for (size_t i = 0; i + 1 < blocks.size(); ++i) {
      blocks[i].set_modules_to_forward_prefetch({blocks[i + 1]});
      blocks[i + 1].set_modules_to_backward_prefetch({blocks[i]});
    }
  }
  return model;
}

// The same tokens on every device: made on the CPU from the step and the rank.
at::Tensor loss_of(fsdp::models::Transformer& model, int64_t step, c10::Device device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + step + 1000 * fsdp::get_rank());
  at::Tensor toks = at::randint(0, 8, {2, 16}, gen).to(device);
  at::Tensor logits = fsdp::call(model, toks);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, 8}).to(at::kFloat), toks.roll(-1, 1).reshape({-1}));
}

Trained train(const RaceCase& c, bool on_gpu) {
  const auto mesh = mesh_for(c, on_gpu && !stand_in_on_cpu() ? "cuda" : "cpu");
  const c10::Device device = mesh.device();
  auto model = build(c, mesh, on_gpu);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.device_state_adamw && on_gpu) {
    opt =
        std::make_unique<fsdp::optim::DeviceStateAdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2), device);
  } else if (c.device_state_adamw) {
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  } else {
    // SGD: the update is linear in the gradient, so a gradient read early, twice or divided
    // wrongly shows in the parameters (Adam's normalisation would hide a wrong scale).
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.1));
  }
  Trained t;
  for (int64_t step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    at::Tensor loss = loss_of(model, step, device);
    loss.backward();
    opt->step();  // before any host sync: a host optimizer reads what backward left
    t.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->parameters()) t.params.push_back(p.detach().to(at::kCPU, at::kFloat).clone());
  return t;
}

// A rank's results in a flat file: the losses, then each parameter (count, then floats).
void save(const std::string& path, const Trained& t) {
  std::ofstream out(path, std::ios::binary);
  auto put = [&](int64_t n, const void* data, size_t bytes) {
    out.write(reinterpret_cast<const char*>(&n), sizeof n);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  };
  put(static_cast<int64_t>(t.losses.size()), t.losses.data(), t.losses.size() * sizeof(double));
  const int64_t count = static_cast<int64_t>(t.params.size());
  out.write(reinterpret_cast<const char*>(&count), sizeof count);
  for (const auto& p : t.params) {
    const at::Tensor c = p.contiguous();
    put(c.numel(), c.data_ptr<float>(), static_cast<size_t>(c.numel()) * sizeof(float));
  }
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

Trained load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  Trained t;
  int64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), sizeof n);
  t.losses.resize(static_cast<size_t>(n));
  in.read(reinterpret_cast<char*>(t.losses.data()), static_cast<std::streamsize>(n * sizeof(double)));
  int64_t count = 0;
  in.read(reinterpret_cast<char*>(&count), sizeof count);
  for (int64_t i = 0; i < count && in.good(); ++i) {
    in.read(reinterpret_cast<char*>(&n), sizeof n);
    at::Tensor p = at::empty({n}, at::kFloat);
    in.read(reinterpret_cast<char*>(p.data_ptr<float>()), static_cast<std::streamsize>(n * sizeof(float)));
    t.params.push_back(p);
  }
  EXPECT_TRUE(in.good()) << "cannot read " << path << " (the run without delay wrote nothing?)";
  return t;
}

// Losses within rtol; parameters (when params_rtol > 0) within allclose(params_rtol, params_rtol / 10).
void expect_same(const Trained& got, const Trained& want, double rtol, double params_rtol, const std::string& what) {
  ASSERT_EQ(got.losses.size(), want.losses.size()) << what;
  for (size_t i = 0; i < got.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], want.losses[i], rtol * std::abs(want.losses[i])) << what << ": loss of step " << i;
  }
  if (params_rtol <= 0) return;
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  for (size_t i = 0; i < got.params.size(); ++i) {
    const at::Tensor& a = got.params[i];
    const at::Tensor b = want.params[i].reshape(a.sizes());
    EXPECT_TRUE(at::allclose(a, b, params_rtol, params_rtol / 10))
        << what << ": parameter " << i << " differs by up to " << (a - b).abs().max().item<double>();
  }
}

std::string result_path(const std::string& dir, const std::string& run) {
  return dir + "/" + run + "-rank" + std::to_string(fsdp::get_rank()) + ".bin";
}

DistOptions options_for(const RaceCase& c, bool delayed) {
  DistOptions o;
  if (c.world() > 1) o.env["FSDP_CUDA_BACKEND"] = "gloo";  // NCCL refuses two ranks on one GPU
  o.env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8";            // deterministic cuBLAS: the runs must agree
  if (delayed) o.env["FSDP_CUDA_SIDE_STREAM_DELAY_CYCLES"] = kDelayCycles;
  return o;
}

// Trains `c` without the delay (and on the CPU path), then with it, and compares. The same
// kernels in the same order on the same GPU: the delay alone may change nothing, so the two GPU
// runs agree to float rounding (1e-5). Against the CPU path: losses to 1e-4 and parameters to
// 1e-3 in fp32, 3e-2 and 1e-2 in bf16.
void check_race_case(const RaceCase& c) {
  const std::string dir = fsdp::testing::shared_temp_path("cuda_races_" + c.name);
  if (!is_child()) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  run_distributed(
      c.world(),
      [&c, &dir] {
        at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
        save(result_path(dir, "gpu"), train(c, /*on_gpu=*/true));
        save(result_path(dir, "cpu"), train(c, /*on_gpu=*/false));
      },
      options_for(c, /*delayed=*/false));
  run_distributed(
      c.world(),
      [&c, &dir] {
        at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
        const Trained delayed = train(c, /*on_gpu=*/true);
        expect_same(delayed, load(result_path(dir, "gpu")), 1e-5, 1e-5, c.name + ", delayed side streams vs none");
        expect_same(delayed, load(result_path(dir, "cpu")), c.bf16 ? 3e-2 : 1e-4, c.bf16 ? 1e-2 : 1e-3,
                    c.name + ", delayed side streams vs the CPU path");
      },
      options_for(c, /*delayed=*/true));
  if (!is_child()) std::filesystem::remove_all(dir);
}

}  // namespace

// One GPU, bf16 compute: each unshard casts the fp32 shard into the all-gather input on the
// copy-in stream, which the compute stream must wait for (nothing is gathered at W=1).
TEST(CudaRaces, MixedPrecisionCastsOnTheCopyInStream) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "mixed_precision_w1", .mesh_shape = {1}, .bf16 = true});
}

// One GPU with a gradient divide factor: the gradients no longer pass straight to the shards but
// are divided on the reduce-scatter stream, which the compute stream and the optimizer must wait for.
TEST(CudaRaces, GradientDivisionOnTheReduceScatterStream) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "divide_factor_w1", .mesh_shape = {1}, .divide_factor = 2.0});
}

// CPU offload on one GPU: shards and gradients in pinned host memory, copied up on the copy-in
// stream and down after backward; the host optimizer must read the gradients only once they landed.
TEST(CudaRaces, CpuOffloadOnOneGpu) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "offload_w1", .mesh_shape = {1}, .offload = true});
}

// The same with bf16 compute: each gradient is cast and copied down to its pinned shard
// without a reduce-scatter.
TEST(CudaRaces, CpuOffloadWithBf16OnOneGpu) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "offload_bf16_w1", .mesh_shape = {1}, .bf16 = true, .offload = true});
}

// CPU offload at W=2 (Gloo staged through pinned memory): copy-in, all-gather, reduce-scatter and
// the copy down to the host each on their stream.
TEST(CudaRaces, CpuOffloadOnTwoRanks) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "offload_w2", .mesh_shape = {2}, .offload = true});
}

// Explicit prefetch at W=2: the next block's all-gather is issued while this one computes, and
// the compute stream must wait for it before that block runs.
TEST(CudaRaces, ExplicitPrefetchOnTwoRanks) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "prefetch_w2", .mesh_shape = {2}, .explicit_prefetch = true});
}

// HSDP 2x2 (Gloo staged): the all-reduce stream reads what the reduce-scatter stream wrote, and
// the gradients are written after both.
TEST(CudaRaces, HsdpTwoByTwo) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "hsdp_2x2", .mesh_shape = {2, 2}});
}

// Offloaded shards with AdamW's state on the GPU (seed002's placement): each shard goes up and
// comes back on the optimizer's copy stream; its device copy must outlive the copy back.
TEST(CudaRaces, DeviceStateAdamWOnOneAndTwoRanks) {
  SKIP_WITHOUT_GPU();
  check_race_case({.name = "device_state_adamw_w1", .mesh_shape = {1}, .offload = true, .device_state_adamw = true});
  check_race_case({.name = "device_state_adamw_w2", .mesh_shape = {2}, .offload = true, .device_state_adamw = true});
}
