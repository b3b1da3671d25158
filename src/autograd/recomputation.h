// recomputation.h — the autograd layer's record of a reentrant recomputation in progress.
//
// Reentrant activation checkpointing (checkpoint_activations.cpp) calls a function again inside
// backward and backpropagates through that recomputation with a nested backward. It opens one
// of these on its thread for the recomputation and the nested backward together. The layers
// above read it: an FSDP module called while one is open is being recomputed, not run for a new
// forward (FSDPState::pre_forward), and end-of-backward callbacks (FSDP's, DDP's reducer's) are
// kept for the outer backward: queued from inside the nested one, they would run when the
// nested one ends. Knows nothing of FSDP or DDP.
#pragma once

#include <functional>
#include <set>
#include <vector>

namespace fsdp {
namespace detail {

class RecomputationScope {
 public:
  RecomputationScope();
  // The outermost scope queues the kept callbacks on the backward it runs in.
  ~RecomputationScope();
  RecomputationScope(const RecomputationScope&) = delete;
  RecomputationScope& operator=(const RecomputationScope&) = delete;

  // The innermost open scope on this thread, or null.
  static RecomputationScope* current();
  // True for the first call of this `owner` (any object of the caller's, e.g. an FSDP state)
  // with grad enabled in this recomputation: FSDP hooks that call's inputs for post-backward, as
  // the first module of a forward round does.
  bool first_call_of(const void* owner) { return owners_called_.insert(owner).second; }
  // Runs `callback` at the end of the outermost backward on this thread: now queued on the
  // current backward when no scope is open, else kept by the outermost scope until it closes.
  static void queue_end_of_backward_callback(std::function<void()> callback);

 private:
  RecomputationScope* enclosing_;
  std::set<const void*> owners_called_;
  std::vector<std::function<void()>> end_of_backward_callbacks_;  // the outermost scope's only
};

}  // namespace detail
}  // namespace fsdp
