// The CUDA path's set-up and its races, each against a reference: when the CUDA path is loaded,
// DeviceStateAdamW's device copies against its copy stream, NCCL groups' creation, names,
// timeouts and ops, and background checkpoints of GPU state. A GPU test holds a stream back with
// a sleep queued on it (as FSDP2's tests do with torch.cuda._sleep), so that a missing wait
// changes the result every time. This binary includes no CUDA header in either configuration:
// it finds the CUDA path's test hooks (cuda_device_ops.cpp) with dlsym. Without a GPU the GPU
// tests report skipped with the reason; the others run in both configurations.
#include "cuda/cuda_testing.h"
#include "harness/multiprocess.h"
#include "src/comm/nccl_settings.h"
#include "src/device/device_ops.h"

#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/device.h>
#include <fsdp/device_state_adamw.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using fsdp::testing::DistOptions;
using fsdp::testing::kGpu;
using fsdp::testing::run_distributed;
using fsdp::testing::sharded;
using fsdp::testing::staged_through_host;
using fsdp::testing::tiny_transformer;

namespace {

// A hook of the CUDA path (cuda_device_ops.cpp), found where the loader put it (RTLD_GLOBAL).
template <typename Fn>
Fn cuda_hook(const char* name) {
  auto fn = reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
  if (fn == nullptr) throw std::runtime_error(std::string("the CUDA path has no test hook ") + name);
  return fn;
}

// Spins the GPU for `cycles` clock cycles on the current stream (at::cuda::sleep).
void gpu_sleep(int64_t cycles) { cuda_hook<void (*)(int64_t)>("fsdp_cuda_testing_sleep")(cycles); }

std::unique_ptr<fsdp::device::DeviceOps> new_cuda_ops() {
  return std::unique_ptr<fsdp::device::DeviceOps>(
      cuda_hook<fsdp::device::DeviceOps* (*)()>("fsdp_cuda_testing_new_ops")());
}

// The CUDA operations, except that every wait of a stream other than `compute` (a side stream's
// wait for the compute stream's work) is followed by a sleep on that stream: whatever the side
// stream does next runs late, while the compute stream goes on.
class SlowSideStreams final : public fsdp::device::DeviceOps {
 public:
  SlowSideStreams(std::unique_ptr<DeviceOps> inner, c10::Stream compute, int64_t cycles)
      : inner_(std::move(inner)), compute_(compute), cycles_(cycles) {}
  int sleeps() const { return sleeps_; }

  c10::DeviceType type() const override { return inner_->type(); }
  c10::Device current_device() override { return inner_->current_device(); }
  void set_current_device(c10::Device d) override { inner_->set_current_device(d); }
  c10::Stream current_stream(c10::Device d) override { return inner_->current_stream(d); }
  c10::Stream side_stream(c10::Device d, bool high) override { return inner_->side_stream(d, high); }
  c10::Stream exchange_stream(c10::Stream s) override { return inner_->exchange_stream(s); }
  fsdp::device::Event record(c10::Stream s) override { return inner_->record(s); }
  void wait(c10::Stream waiter, const fsdp::device::Event& e) override {
    inner_->wait(waiter, e);
    if (waiter == compute_) return;
    const c10::Stream previous = inner_->exchange_stream(waiter);
    gpu_sleep(cycles_);
    inner_->exchange_stream(previous);
    ++sleeps_;
  }
  void synchronize(const fsdp::device::Event& e) override { inner_->synchronize(e); }
  void copy_bytes(void* dst, const void* src, size_t n) override { inner_->copy_bytes(dst, src, n); }
  void zero_bytes(void* dst, size_t n) override { inner_->zero_bytes(dst, n); }
  void resize_storage(c10::StorageImpl& s, size_t n) override { inner_->resize_storage(s, n); }
  bool can_pin_host_memory() const override { return inner_->can_pin_host_memory(); }
  bool has_streams() const override { return inner_->has_streams(); }
  bool shares_host_memory() const override { return inner_->shares_host_memory(); }
  at::Tensor to_host(const at::Tensor& t, at::ScalarType dtype, bool pinned, bool non_blocking) override {
    return inner_->to_host(t, dtype, pinned, non_blocking);
  }
  at::Tensor to_device(const at::Tensor& t, c10::Device device, at::ScalarType dtype, bool non_blocking) override {
    return inner_->to_device(t, device, dtype, non_blocking);
  }
  at::Tensor empty_like_on(const at::Tensor& like, c10::Device device) override {
    return inner_->empty_like_on(like, device);
  }
  int device_count() const override { return inner_->device_count(); }
  fsdp::DeviceMemoryStats memory_stats(c10::Device d) override { return inner_->memory_stats(d); }
  void reset_peak_memory(c10::Device d) override { inner_->reset_peak_memory(d); }

 private:
  std::unique_ptr<DeviceOps> inner_;
  c10::Stream compute_;
  int64_t cycles_;
  int sleeps_ = 0;
};

// SlowSideStreams registered for CUDA for a scope; plain CUDA operations again after it.
class SlowSideStreamsScope {
 public:
  explicit SlowSideStreamsScope(int64_t cycles) {
    auto ops =
        std::make_unique<SlowSideStreams>(new_cuda_ops(), fsdp::device::ops_for(kGpu).current_stream(kGpu), cycles);
    ops_ = ops.get();
    fsdp::device::register_ops(std::move(ops));
  }
  ~SlowSideStreamsScope() { fsdp::device::register_ops(new_cuda_ops()); }
  const SlowSideStreams& ops() const { return *ops_; }

 private:
  SlowSideStreams* ops_;
};

std::vector<double> train(fsdp::models::Transformer& model, int steps = 3) {
  torch::optim::Adam opt(model->parameters(), 1e-2);
  std::vector<double> losses;
  for (int64_t step = 0; step < steps; ++step) {
    opt.zero_grad();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step + 1000 * fsdp::get_rank());
    at::Tensor toks = at::randint(0, 8, {2, 16}, gen).to(kGpu);
    at::Tensor logits = fsdp::call(model, toks);
    at::Tensor loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 8}), toks.roll(-1, 1).reshape({-1}));
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

}  // namespace

// ------------------------------------------------------------------ when the CUDA path is loaded

// ATen asks once whether it has CUDA and keeps the answer. A program's first line asking it (as
// torch::manual_seed does) must find the CUDA path already loaded in a CUDA build: libfsdp loads
// it when it is itself loaded. Runs in a child process, whose first ATen call is the one below.
TEST(CudaPathLoading, ATenSeesTheCudaPathEvenWhenAskedBeforeAnyFsdpCall) {
  torch::manual_seed(0);  // the first line of a user's main()
  const bool aten_has_cuda_runtime = at::Context::hasCUDART();
  run_distributed(1, [aten_has_cuda_runtime] {
    EXPECT_EQ(aten_has_cuda_runtime, bool(FSDP_TESTS_CUDA_BUILD)) << "ATen's answer was fixed too early";
    EXPECT_EQ(fsdp::built_with_cuda(), bool(FSDP_TESTS_CUDA_BUILD)) << fsdp::device::load_cuda_path_error();
  });
}

// FSDP_CUDA_PATH=lazy defers the loading to the first CUDA query, and a program that asked ATen
// first is then refused with the reason and the remedy, not left with a CUDA that half works.
TEST(CudaPathLoading, DeferredPastATensAnswerItIsRefusedWithTheReason) {
  torch::manual_seed(0);  // the first line of a user's main()
  DistOptions lazy;
  lazy.env["FSDP_CUDA_PATH"] = "lazy";
  run_distributed(
      1,
      [] {
        EXPECT_FALSE(fsdp::built_with_cuda());
        const std::string why = fsdp::cuda_unavailable_reason();
        if (FSDP_TESTS_CUDA_BUILD) {
          EXPECT_NE(why.find("after ATen had decided"), std::string::npos) << why;
          EXPECT_NE(why.find("FSDP_CUDA_PATH"), std::string::npos) << why;
        }
      },
      lazy);
}

// The same program on a GPU: the first line seeded the CUDA generator, and pinned host memory
// works, so fully_shard's pinned CPU offload trains like no offload.
TEST(CudaPathLoading, SeedingFirstStillSeedsTheGpuAndPinsOffloadedShards) {
  torch::manual_seed(0);  // the first line of a user's main()
  SKIP_WITHOUT_GPU();
  run_distributed(
      2,
      [] {
        const at::Tensor first = at::rand({8}, at::TensorOptions().device(kGpu));  // from that seed
        torch::manual_seed(0);
        EXPECT_TRUE(first.equal(at::rand({8}, at::TensorOptions().device(kGpu))));
        auto mesh = fsdp::init_device_mesh("cuda", {fsdp::get_world_size()});
        auto offloaded = sharded(mesh, fsdp::FullyShardOptions().offload_policy(fsdp::CPUOffloadPolicy()));
        auto plain = sharded(mesh);
        for (const auto& p : offloaded->parameters()) EXPECT_TRUE(p.is_cpu() && p.is_pinned());
        const std::vector<double> a = train(offloaded), b = train(plain);
        for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * std::abs(b[i])) << "step " << i;
      },
      staged_through_host());
}

// ------------------------------------------------------------------ DeviceStateAdamW

// Each parameter's device copy is allocated on the compute stream and read back to the host on
// the copy stream. With the download held back by a sleep, the compute stream's next allocations
// (the last parameter's state at the first step, the update's temporaries) take any copy freed
// too early and overwrite it before it is read: the host parameter is then not AdamW's. Large
// parameters of one size, so that every freed copy fits the next allocation.
TEST(CudaDefects, DeviceStateAdamWKeepsEachDeviceCopyUntilItsDownloadRan) {
  SKIP_WITHOUT_GPU();
  SlowSideStreamsScope slow(/*cycles=*/100'000'000);  // tens of ms before each copy
  const int64_t n = int64_t{16} << 20;                // 64 MiB of fp32
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> params, reference;
  for (int i = 0; i < 3; ++i) {
    params.push_back(at::randn({n}, gen).pin_memory().requires_grad_(true));
    reference.push_back(params.back().detach().clone().requires_grad_(true));
  }
  const auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fsdp::optim::DeviceStateAdamW opt(params, options, kGpu);
  torch::optim::AdamW host(reference, options);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor grad = at::randn({n}, gen);
      params[i].mutable_grad() = grad.pin_memory();
      reference[i].mutable_grad() = grad.clone();
    }
    opt.step();
    host.step();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(at::allclose(params[i], reference[i], 1e-5, 1e-6))
          << "parameter " << i << " after step " << step << ": largest difference "
          << (params[i] - reference[i]).abs().max().item<float>();
    }
  }
  EXPECT_GT(slow.ops().sleeps(), 0) << "the copy stream was never held back: the test shows nothing";
}

// ------------------------------------------------------------------ NCCL set-up

TEST(NcclSettings, AvgOnOneRankRunsAsSum) {
  using fsdp::ReduceOp;
  EXPECT_EQ(fsdp::comm::nccl_reduce_op(ReduceOp::kAvg, 1), ReduceOp::kSum);
  EXPECT_EQ(fsdp::comm::nccl_reduce_op(ReduceOp::kAvg, 2), ReduceOp::kAvg);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    EXPECT_EQ(fsdp::comm::nccl_reduce_op(op, 1), op);
    EXPECT_EQ(fsdp::comm::nccl_reduce_op(op, 4), op);
  }
}

TEST(NcclSettings, AGroupGivesC10dItsNameAndWorldRanks) {
  const fsdp::comm::NcclGroupIdentity id = fsdp::comm::nccl_group_identity("g3[1,3]", {1, 3});
  EXPECT_EQ(id.group_name, "g3[1,3]");
  EXPECT_NE(id.group_desc.find("g3[1,3]"), std::string::npos);
  EXPECT_EQ(id.global_ranks_in_group, (std::vector<uint64_t>{1, 3}));
}

TEST(NcclSettings, AGroupThatCannotBeMadeSaysWhatToDo) {
  EXPECT_NE(fsdp::comm::nccl_init_remedy("ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA "
                                         "device 1000")
                .find("FSDP_CUDA_BACKEND=gloo"),
            std::string::npos);
  EXPECT_NE(fsdp::comm::nccl_init_remedy("Socket Timeout").find("every member of the group"), std::string::npos);
}

// c10d's default (3) ends the process from its watchdog on a timeout; 2 aborts the group and
// lets the next collective fail. A value the environment already has is kept.
TEST(NcclSettings, ATimeoutAbortsTheGroupUnlessTheEnvironmentSaysOtherwise) {
  const char* name = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
  const char* before = std::getenv(name);
  const std::string saved = before ? before : "";
  unsetenv(name);
  fsdp::comm::apply_nccl_env_defaults();
  EXPECT_STREQ(std::getenv(name), "2");
  setenv(name, "1", 1);
  fsdp::comm::apply_nccl_env_defaults();
  EXPECT_STREQ(std::getenv(name), "1");
  if (before) {
    setenv(name, saved.c_str(), 1);
  } else {
    unsetenv(name);
  }
}

namespace {

// The value `name` had when this process started (setenv does not change /proc/self/environ).
std::optional<std::string> initial_env(const std::string& name) {
  std::ifstream f("/proc/self/environ", std::ios::binary);
  std::string entry;
  while (std::getline(f, entry, '\0')) {
    if (entry.rfind(name + "=", 0) == 0) return entry.substr(name.size() + 1);
  }
  return std::nullopt;
}

}  // namespace

// The CUDA path applies them when it is loaded (with libfsdp, before main), keeping a value the
// process started with; a CPU build sets nothing.
TEST(NcclSettings, TheCudaPathAppliesThemWhenItIsLoaded) {
  DistOptions chosen;
  chosen.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
  run_distributed(
      1, [] { EXPECT_STREQ(std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "1"); }, chosen);
  if (fsdp::testing::is_child()) return;
  if (initial_env("TORCH_NCCL_ASYNC_ERROR_HANDLING")) {
    GTEST_SKIP() << "TORCH_NCCL_ASYNC_ERROR_HANDLING is set in this test's environment";
  }
  const bool cuda = fsdp::built_with_cuda();
  const char* value = std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING");
  if (cuda) {
    EXPECT_STREQ(value, "2");
  } else {
    EXPECT_EQ(value, nullptr) << value;
  }
}

// NCCL refuses two ranks of a group on one GPU. The group's communicator is made when the group
// is, so init_device_mesh says so, with the remedy, instead of the first forward.
TEST(CudaDefects, TwoRanksOnOneGpuAreRefusedAtInitDeviceMesh) {
  SKIP_WITHOUT_GPU();
  if (fsdp::cuda_device_count() != 1) GTEST_SKIP() << "needs a machine with exactly one GPU";
  run_distributed(2, [] {
    try {
      fsdp::init_device_mesh("cuda", {2});
      ADD_FAILURE() << "two ranks on one GPU made an NCCL mesh";
    } catch (const fsdp::CollectiveError& e) {
      EXPECT_NE(std::string(e.what()).find("FSDP_CUDA_BACKEND=gloo"), std::string::npos) << e.what();
    }
  });
}

// A collective held back (a sleep queued before it) past the group's timeout: c10d's watchdog
// finds it, and the group's next collective fails with fsdp-cpp's CollectiveError while the
// process lives on past the point where the watchdog would have ended it (its dump window, 4 x
// TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC after the timeout). The sleep ends well before that
// point, so the communicator is aborted with nothing of it in flight.
TEST(CudaDefects, AnNcclTimeoutFailsTheNextCollectiveAndTheProcessLives) {
  SKIP_WITHOUT_GPU();
  DistOptions o;
  o.collective_timeout = std::chrono::milliseconds(1000);
  o.env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "1500";  // the abort comes about 7 s after the start
  o.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0";
  run_distributed(
      1,
      [] {
        auto mesh = fsdp::init_device_mesh("cuda", {1});
        auto pg = mesh.get_group(0);
        const auto start = std::chrono::steady_clock::now();
        at::Tensor x = at::ones({4}, at::TensorOptions().device(kGpu));
        gpu_sleep(4'000'000'000);  // 2 to 4 s, at 1 to 2 GHz: past the 1 s timeout
        pg->all_reduce(x)->wait();
        std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the watchdog has seen it by now
        at::Tensor out = at::empty({4}, x.options());
        try {
          pg->all_gather_into(out, at::ones({4}, x.options()))->wait();
          ADD_FAILURE() << "a collective after the timeout ran";
        } catch (const fsdp::CollectiveError& e) {
          const std::string what = e.what();
          for (const std::string& part :
               {std::string("all_gather"), pg->name(), std::string("this is rank 0"), std::string("timeout")}) {
            EXPECT_NE(what.find(part), std::string::npos) << part << " missing from: " << what;
          }
        }
        std::this_thread::sleep_until(start + std::chrono::seconds(10));  // past the watchdog's abort
        EXPECT_TRUE(x.cpu().equal(at::ones({4})));                        // the held-back all-reduce ran before it
        EXPECT_THROW(pg->barrier()->wait(), fsdp::CollectiveError);
      },
      o);
}

// ------------------------------------------------------------------ background checkpoint saves

// The save stages the GPU's pieces in pinned host memory: the GPU allocator's peak does not grow
// by the state, and what is saved is the state when save_async was called, though training
// changes it right after and the staging copies are held back by a sleep.
TEST(CudaDefects, ABackgroundSaveOfGpuStateStagesItInHostMemory) {
  SKIP_WITHOUT_GPU();
  const std::string root = fsdp::testing::shared_temp_path("gpu_async_save");
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(root);
  run_distributed(1, [root] {
    auto mesh = fsdp::init_device_mesh("cuda", {1});
    const int64_t n = int64_t{16} << 20;  // 64 MiB of fp32
    at::Tensor w = at::randn({n}, at::TensorOptions().device(kGpu));
    fsdp::ShardedStateDict sd;
    sd.insert("w", fsdp::DTensor::from_local(w, mesh, {fsdp::Shard(0)}));
    const at::Tensor expected = w.cpu();
    fsdp::CheckpointManager manager(root);
    const int64_t before = fsdp::device_memory_stats(kGpu).allocated_bytes;
    fsdp::reset_peak_device_memory(kGpu);
    gpu_sleep(200'000'000);  // the staging copies queue behind this
    manager.save_async(1, sd);
    const int64_t grew = fsdp::device_memory_stats(kGpu).max_allocated_bytes - before;
    w.add_(1.0);  // the next step
    manager.wait();
    EXPECT_LT(grew, n) << "the save took " << grew << " bytes of GPU memory for a state of " << n * 4;
    const fsdp::ShardedStateDict loaded = fsdp::load_checkpoint(root + "/step_1", sd);
    EXPECT_TRUE(loaded["w"].to_local().cpu().equal(expected));
  });
  if (!fsdp::testing::is_child()) std::filesystem::remove_all(root);
}
