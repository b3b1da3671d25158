// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/replicate_sync.h — making the replicas of an HSDP model start identical.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {replicas, shards}, {"replicate", "shard"});
///   Model model(/*seed=*/...);                         // may differ between replicas
///   for (auto& block : model->blocks()) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh));
///   fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh));
///   fsdp::sync_module_states(*model, mesh);            // every replica now holds replica 0's values
/// \endcode
///
/// fully_shard never broadcasts (neither does PyTorch's FSDP): under HSDP each replica keeps the
/// values its ranks started with, and the all-reduced gradients keep replicas that started equal
/// equal, but do nothing for ones that did not. Call this once after building the model (before
/// or after fully_shard), or after loading values on some replicas only.
#pragma once

#include <fsdp/device_mesh.h>

#include <torch/nn/module.h>

namespace fsdp {

/// Copies, over the replicate dim (dim 0) of the 2-D `mesh`, every parameter and buffer of
/// `module` from the rank with replicate coordinate 0 to the other ranks of its replicate group:
/// a parameter sharded by fully_shard as its local shard (which the ranks of one replicate group
/// hold the same piece of), any other parameter or buffer whole. Writes in place (the storage of
/// every tensor stays; optimizer references stay valid); tensors are coalesced per dtype, one
/// broadcast each. Collective over each replicate group: every rank of the mesh calls it with the
/// same module structure. Call it while the FSDP modules are resharded (after fully_shard, or
/// after a step), not between a forward and its backward. Throws c10::Error when `mesh` is not
/// 2-D, or when a sharded parameter lives on another mesh.
void sync_module_states(torch::nn::Module& module, const DeviceMesh& mesh);

}  // namespace fsdp
