// recomputation.cpp — the thread's innermost RecomputationScope, and the end-of-backward
// callbacks its outermost scope keeps for the outer backward.
#include "src/autograd/recomputation.h"

#include <torch/csrc/autograd/engine.h>

namespace fsdp {
namespace detail {
namespace {

thread_local RecomputationScope* t_innermost_recomputation = nullptr;

}  // namespace

RecomputationScope::RecomputationScope() : enclosing_(t_innermost_recomputation) { t_innermost_recomputation = this; }

RecomputationScope::~RecomputationScope() {
  t_innermost_recomputation = enclosing_;
  if (enclosing_) return;  // callbacks are kept by the outermost scope only
  // The outermost scope is opened by a backward function of the outer backward, which is then
  // the engine's current backward, so queue_callback succeeds; still, nothing may leave a
  // destructor.
  for (auto& cb : end_of_backward_callbacks_) {
    try {
      torch::autograd::Engine::get_default_engine().queue_callback(std::move(cb));
    } catch (...) {
    }
  }
}

RecomputationScope* RecomputationScope::current() { return t_innermost_recomputation; }

void RecomputationScope::queue_end_of_backward_callback(std::function<void()> callback) {
  RecomputationScope* scope = t_innermost_recomputation;
  if (!scope) {
    torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
    return;
  }
  while (scope->enclosing_) scope = scope->enclosing_;
  scope->end_of_backward_callbacks_.push_back(std::move(callback));
}

}  // namespace detail
}  // namespace fsdp
