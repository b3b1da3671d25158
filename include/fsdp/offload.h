// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/offload.h — CPUOffloadPolicy: keep a group's sharded parameters, their gradients and the
/// optimizer state in host memory, and step the optimizer there.
///
/// \code{.cpp}
///   auto offload = fsdp::CPUOffloadPolicy().pin_memory(false);   // a CPU build has no pinned memory
///   fsdp::fully_shard(block, fsdp::FullyShardOptions().offload_policy(offload));
/// \endcode
///
/// With the policy (PyTorch FSDP2's semantics):
///  - The sharded parameters live in host memory from fully_shard on; parameters(), the optimizer
///    built on them, state dicts and checkpoints see host tensors.
///  - Each unshard first copies this rank's shard to the mesh's device, then all-gathers there; the
///    unsharded parameters live on that device and are freed as reshard_after_forward says.
///  - Each reduce-scatter's output is copied back to host memory and becomes (or is added to) the
///    sharded gradient, so the optimizer steps on the host.
///  - Before the first forward, every sharded parameter must still be in host memory (a state dict
///    loaded onto another device breaks that): the error names each parameter and its device.
/// On a CPU mesh the device is the host, so both copies are identities and training is bitwise
/// the same as without the policy; the same code does real host `<->` device copies on a CUDA mesh.
#pragma once

#include <torch/arg.h>

#include <string>

namespace fsdp {

/// FSDP2's CPUOffloadPolicy: keep the sharded parameters, their gradients and the optimizer state
/// in host memory (FullyShardOptions::offload_policy).
struct CPUOffloadPolicy {
  /// Page-locked host buffers, so host `<->` device copies can run asynchronously. They need CUDA:
  /// a CPU-only build refuses true (pass pin_memory(false)).
  TORCH_ARG(bool, pin_memory) = true;

 public:
  /// "CPUOffloadPolicy(pin_memory=false)", for logs and errors.
  std::string str() const {
    return std::string("CPUOffloadPolicy(pin_memory=") + (pin_memory() ? "true" : "false") + ")";
  }
};

}  // namespace fsdp
