// A small FSDP training program that fsdprun starts in the flight-recorder tests, with one
// fault on rank 1 at step 2 (0-based steps; steps 0 and 1 are normal):
//   flight_worker skip DIR    rank 1 skips the step (a data-loader stall): it never enters the
//                             forward all-gathers; it sleeps until it is stopped
//   flight_worker stop DIR    rank 1 stops itself (SIGSTOP) in the middle of the backward
//   flight_worker raise DIR   rank 1 throws from a gradient hook in the middle of the backward
//                             (uncaught: std::terminate, SIGABRT), once rank 0 has issued the
//                             reduce-scatter that rank 1 will never join
//   flight_worker exit DIR    every rank stops at step 2 with exit code 3 (an error, not a hang)
//   flight_worker run DIR     no fault; 200 steps, for fsdprun --dump on a running job
// Each rank writes DIR/pid_R once it has finished step 0, so a test can wait for the job.
#include <fsdp/call.h>
#include <fsdp/custom_comm.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>

#include <ATen/Functions.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl() { lin = register_module("lin", torch::nn::Linear(32, 32)); }
  at::Tensor forward(const at::Tensor& x) { return at::tanh(lin->forward(x)); }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() { blocks = register_module("blocks", torch::nn::ModuleList(Block(), Block(), Block(), Block())); }
  // `fault` runs when the gradient reaches the input of blocks.2: after the backward of blocks.3
  // and blocks.2, before that of blocks.1 and blocks.0.
  at::Tensor forward(const at::Tensor& x, const std::function<void()>& fault) {
    at::Tensor h = x;
    for (size_t i = 0; i < blocks->size(); ++i) {
      if (i == 2 && fault) h.register_hook([fault](const at::Tensor&) { fault(); });
      h = fsdp::call(blocks[i]->as<BlockImpl>(), h);
    }
    return h;
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Net);

// Issues the reduce-scatter as FSDP would, then leaves a file saying so: the raising rank waits
// for it, so that the dumps always find rank 0 inside a collective rank 1 never entered.
struct AnnouncedReduceScatter : fsdp::ReduceScatter {
  explicit AnnouncedReduceScatter(std::string path) : path(std::move(path)) {}
  fsdp::WorkHandle operator()(const at::Tensor& output, const at::Tensor& input, fsdp::ProcessGroup& group,
                              fsdp::ReduceOp op) override {
    fsdp::WorkHandle work = group.reduce_scatter_into(output, input, op);
    if (armed) std::ofstream(path) << "issued\n";
    return work;
  }
  std::string path;
  bool armed = false;  // in the step where rank 1 raises
};

void wait_for_file(const std::string& path) {
  for (int i = 0; i < 600 && !std::filesystem::exists(path); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: fsdprun_flight_worker skip|stop|raise|exit|run DIR\n";
    return 64;
  }
  const std::string mode = argv[1], dir = argv[2];
  fsdp::init_process_group();
  const int rank = fsdp::get_rank();
  torch::manual_seed(0);
  Net net;
  for (const auto& block : net->blocks->children()) fsdp::fully_shard(block);
  fsdp::fully_shard(net);
  const std::string announced = dir + "/rank0_reduces_blocks1";
  auto announcer = std::make_shared<AnnouncedReduceScatter>(announced);
  if (mode == "raise" && rank == 0) fsdp::get_fsdp_module(*net->blocks[1]).set_custom_reduce_scatter(announcer);
  const int steps = mode == "run" ? 200 : 4;
  for (int step = 0; step < steps; ++step) {
    if (mode == "exit" && step == 2) {
      std::cerr << "rank " << rank << " stops: bad input" << std::endl;
      return 3;
    }
    const bool faulty = rank == 1 && step == 2;
    announcer->armed = step == 2;
    if (faulty && mode == "skip") {
      std::cerr << "rank 1 skips step 2" << std::endl;
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    std::function<void()> fault;
    if (faulty && mode == "stop") fault = [] { raise(SIGSTOP); };
    if (faulty && mode == "raise") {
      fault = [announced] {
        wait_for_file(announced);
        throw std::runtime_error("rank 1 fails in backward");
      };
    }
    at::Tensor x = at::randn({8, 32});
    at::Tensor loss = fsdp::call(net.ptr().get(), x, fault).square().mean();
    loss.backward();
    for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
    if (step == 0) std::ofstream(dir + "/pid_" + std::to_string(rank)) << getpid() << "\n";
    if (mode == "run") std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::cout << "rank " << rank << " done" << std::endl;
  return 0;
}
