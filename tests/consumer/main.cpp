// A program of one's own against an installed fsdp-cpp (docs/own-program.md): joins the world
// (one process, or as many as fsdprun starts), shards a tensor over them and gathers it back.
// Every public header is included, so that one needing anything not installed fails to build.
#include <fsdp/call.h>
#include <fsdp/checkpoint.h>
#include <fsdp/clip_grad.h>
#include <fsdp/device_mesh.h>
#include <fsdp/distributed.h>
#include <fsdp/dtensor.h>
#include <fsdp/fsdp_module.h>
#include <fsdp/fully_shard.h>
#include <fsdp/memory.h>
#include <fsdp/models/transformer.h>
#include <fsdp/optim_state_dict.h>
#include <fsdp/placement.h>
#include <fsdp/process_group.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/trace.h>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  fsdp::init_process_group();
  auto mesh = fsdp::init_device_mesh("cpu", {fsdp::get_world_size()}, {"dp"});
  at::Tensor full = at::arange(6, at::kFloat).view({3, 2});
  auto d = fsdp::distribute_tensor(full, mesh, {fsdp::Shard(0)});
  const bool ok = d.full_tensor().equal(full);
  std::cout << "consumer rank " << fsdp::get_rank() << ": " << mesh.str() << " full_tensor "
            << (ok ? "matches" : "DIFFERS") << std::endl;
  fsdp::destroy_process_group();
  return ok ? 0 : 1;
}
