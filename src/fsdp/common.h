// common.h — the states fully_shard's runtime moves through, shared by the per-call state
// (state.h) and the parameter group (param_group.h). Nothing here talks to a process group.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace fsdp {
namespace detail {

// How messages, traces and the flight recorder name an FSDP module: its FQN, and "(root)" for
// the root module, whose FQN is empty. One spelling, so a name in an error can be found in a
// trace or a flight-recorder dump.
inline std::string module_label(const std::string& fqn) { return fqn.empty() ? "(root)" : fqn; }

// Where a state (or its parameter group) is in the training iteration. Each hook checks it
// first: a forward re-run during backward (activation recomputation) must not redo forward's
// bookkeeping, and a group whose backward hook already fired for one output must not unshard
// again for the next.
enum class TrainingState {
  // Between iterations, and between a module's forward and its backward. Entered at
  // construction, at the end of post-forward, and by the end-of-backward callback.
  kIdle,
  // The module's forward is running. Entered by pre-forward; left by post-forward (for a group
  // of several modules, once every one of them has run, or at the end of the root's forward).
  kForward,
  // The gradient of one of the module's outputs has arrived; its backward is running. Entered
  // by the pre-backward hook on the outputs; left by post-backward.
  kPreBackward,
  // The gradients of the module's inputs are known: its parameters' gradients are complete and
  // their reduce-scatter is issued. Entered by post-backward (from the autograd function on the
  // inputs, or from the end-of-backward callback for groups autograd did not reach); left by the
  // end-of-backward callback.
  kPostBackward,
};

// Where a group's parameters live. The sharded leaves always exist; these states say what the
// modules' unsharded tensors hold.
enum class ShardedState {
  // Only this rank's shards; the unsharded tensors have zero-byte storage. Entered at
  // construction and by reshard(); left by the copy-out of an all-gather.
  kSharded,
  // After forward with reshard_after_forward = k (1 < k < shard group size): this rank keeps
  // 1/k of every unsharded parameter, for an all-gather among k ranks in backward. Entered by
  // post-forward; left by that all-gather's copy-out, or by reshard().
  kShardedPostForward,
  // The unsharded tensors hold the whole parameters (on a mesh of one rank they alias the
  // shards and the group never leaves this state). Entered by the copy-out of an all-gather;
  // left by reshard() or the partial reshard after forward.
  kUnsharded,
};

// The dtypes of one group's tensors, resolved from its mixed-precision policy at fully_shard
// (policies.h). Without a policy all three are the parameters' dtype.
struct GroupDtypes {
  at::ScalarType orig;       // the sharded leaves and the flat shard (what the optimizer sees)
  at::ScalarType unsharded;  // the all-gather, the unsharded parameters and their gradients
  at::ScalarType reduce;     // the reduce-scatter (and no-sync gradient accumulation)
};

// Where one group's tensors live, resolved from its mesh and offload policy at fully_shard.
// Without CPU offload both are the mesh's device.
struct GroupDevices {
  c10::Device compute;  // the all-gather, the unsharded parameters, the reduce-scatter
  c10::Device shard;    // the flat shard, the sharded parameters and their gradients (host under offload)
  bool non_blocking;    // copies between the two may run asynchronously (pinned host memory)
  bool offloaded;       // CPU offload: the shards are in host memory, copied to and from the device
};

}  // namespace detail
}  // namespace fsdp
