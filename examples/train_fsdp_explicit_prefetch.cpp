// train_fsdp_explicit_prefetch — train_fsdp.cpp with explicit prefetching: the C++ version of
// PyTorch's FSDP2 training example run with --explicit-prefetch. Everything is the same as in
// train_fsdp.cpp except the parts marked "explicit prefetch":
//   - while block i runs forward, the all-gathers of blocks i+1 and i+2 are already issued
//     (set_modules_to_forward_prefetch); in backward, block i prefetches blocks i-1 and i-2
//     (set_modules_to_backward_prefetch). More overlap of communication with compute, at the
//     cost of holding up to three blocks' gathered parameters at once;
//   - each step starts the root's all-gather with unshard(async_op = true) before the batch is
//     prepared, so that communication overlaps the data loading instead of the first forward.
//
//   build/tools/fsdprun/fsdprun --standalone --nproc-per-node 2 build/examples/train_fsdp_explicit_prefetch
//       [--steps 10] [--batch 8] [--seq S] [--preset tiny|small|medium]
//
// --batch is the global batch (split evenly over the ranks); --seq defaults to the preset's
// max_seq_len. Run without the launcher it trains as a single process (world size 1).
#include "example_util.h"

#include <fsdp/call.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

using examples::get_batch;
using examples::Options;
using examples::parse_args;

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);

  // 1. Join the job. fsdprun (or torchrun) sets RANK, WORLD_SIZE, MASTER_ADDR, ... for us.
  fsdp::init_process_group();
  const int rank = fsdp::get_rank(), world = fsdp::get_world_size();
  TORCH_CHECK(opt.batch % world == 0, "--batch (", opt.batch, ") must be divisible by the world size (", world, ")");

  // A 1-D mesh over all ranks: plain FSDP, every parameter is split over all of them.
  fsdp::DeviceMesh mesh = fsdp::init_device_mesh("cpu", {world});

  // 2. Build the model. fully_shard keeps each rank's own piece of the weights it finds, so
  //    every rank must start from the same weights: seed the initialisation identically.
  fsdp::models::ModelArgs args = fsdp::models::ModelArgs::preset(opt.preset);
  const int64_t seq = opt.seq > 0 ? opt.seq : args.max_seq_len;
  torch::manual_seed(0);
  fsdp::models::Transformer model(args);
  const int64_t full_numel = fsdp::models::count_parameters(*model);

  // 3. Shard bottom-up: each block first (one all-gather / reduce-scatter per block), then the
  //    root, which takes the remaining parameters (embeddings, final norm, output head).
  //    Default options: non-root modules free their gathered parameters after forward; the
  //    root keeps them (backward needs them at once).
  //    Keep the handles fully_shard returns: the prefetch settings below are made on them.
  std::vector<fsdp::FSDPModule> blocks;
  for (auto& block : model->blocks()) blocks.push_back(fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh)));
  fsdp::FSDPModule root = fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));

  // Explicit prefetch. PyTorch's example skips the blocks that do not have two neighbours; here
  // a block near either end prefetches the one neighbour it has (a one-element list behaves like
  // the default), so that the 2-block tiny preset gets prefetching too.
  const int num_to_forward_prefetch = 2, num_to_backward_prefetch = 2;
  const int n_blocks = static_cast<int>(blocks.size());
  for (int i = 0; i < n_blocks; ++i) {
    std::vector<fsdp::FSDPModule> next, previous;
    for (int j = 1; j <= num_to_forward_prefetch && i + j < n_blocks; ++j) next.push_back(blocks[i + j]);
    for (int j = 1; j <= num_to_backward_prefetch && i - j >= 0; ++j) previous.push_back(blocks[i - j]);
    if (!next.empty()) blocks[i].set_modules_to_forward_prefetch(next);           // i+1, i+2
    if (!previous.empty()) blocks[i].set_modules_to_backward_prefetch(previous);  // i-1, i-2 (backward order)
  }

  // 4. Every registered parameter is now this rank's Shard(0) piece of a DTensor.
  int64_t n_params = 0;
  for (const at::Tensor& p : model->parameters()) {
    TORCH_CHECK(fsdp::is_sharded_parameter(p), "a parameter was not sharded by fully_shard");
    const fsdp::DTensor d = fsdp::as_dtensor(p);  // a view of p: its shard, the mesh, the global shape
    TORCH_CHECK(d.placements().size() == 1 && d.placements()[0] == fsdp::Shard(0), "unexpected placement ",
                d.placements()[0].str());
    ++n_params;
  }
  if (rank == 0) {
    std::cout << "preset " << opt.preset << ": " << args.n_layers << " blocks, " << full_numel << " parameters; world "
              << world << "\n"
              << "all " << n_params << " parameters are sharded with Shard(0)\n";
  }

  // The DTensor view of one parameter: the local shard, and the whole tensor gathered back
  // (full_tensor() is collective: every rank calls it). This is also how a full state dict
  // for a checkpoint would be assembled.
  {
    const std::string name = "layers.0.attention.wq.weight";
    fsdp::DTensor d = fsdp::as_dtensor(model->named_parameters()[name]);
    at::Tensor full = d.full_tensor();
    std::ostringstream line;
    line << name << ": local shard " << d.to_local().sizes() << " of global " << c10::IntArrayRef(d.sizes()) << " "
         << d.placements()[0].str() << "; full_tensor() " << full.sizes() << "\n";
    std::cout << line.str() << std::flush;
  }

  // 5. The optimizer is built after fully_shard, on the sharded parameters: each rank updates
  //    only its shards (and keeps Adam's state only for them).
  torch::optim::Adam optim(model->parameters(), torch::optim::AdamOptions(1e-2));

  // 6. Train. The forward goes through fsdp::call, FSDP's hook point (LibTorch has no forward
  //    hooks); on an unsharded model it is a plain forward, so this loop runs unchanged on one
  //    process without fully_shard.
  auto world_group = fsdp::world();
  for (int step = 0; step < opt.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    // Explicit prefetch: issue the root's all-gather now, so that it overlaps whatever runs
    // before the forward (here: making the batch). Its pre-forward waits for it.
    root.unshard(/*async_op=*/true);
    auto [inputs, targets] = get_batch(step, opt.batch, seq, args.vocab_size, rank, world);

    at::Tensor logits = fsdp::call(model, inputs);  // [B/W, seq, vocab]
    at::Tensor loss =
        torch::nn::functional::cross_entropy(logits.reshape({-1, args.vocab_size}), targets.reshape({-1}));
    loss.backward();  // gradients are reduce-scattered: each rank gets its shard's average gradient
    optim.step();
    optim.zero_grad();

    // Each rank's loss is over its own rows; average them for the log line.
    at::Tensor mean_loss = loss.detach().clone();
    world_group->all_reduce(mean_loss, fsdp::ReduceOp::kAvg)->wait();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) std::printf("step %2d  loss %.4f  (%.3f s)\n", step, mean_loss.item<double>(), secs);
    std::fflush(stdout);
  }
  return 0;
}
