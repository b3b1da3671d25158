// fsdp/compat.h — every difference between the LibTorch versions fsdp-cpp builds
// against lives here, and nowhere else.
//
// Supported: LibTorch 1.13 (Debian 12's libtorch-dev; its torch/version.h says 1.13.0)
// and LibTorch 2.x (e.g. the one inside a PyTorch 2.11 install, with or without CUDA).
// Code elsewhere uses the macros below instead of testing versions itself.
#pragma once

#include <torch/version.h>

// True when the LibTorch being compiled against is at least major.minor.
// Gate on major and minor only: Debian's 1.13.1 reports patch level 0.
#define FSDP_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||               \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !FSDP_TORCH_VERSION_AT_LEAST(1, 13)
#error "fsdp-cpp needs LibTorch 1.13 or newer"
#endif

// c10::Allocator: 1.13 has `DataPtr allocate(size_t) const` and no copy_data;
// newer releases have a non-const allocate and a pure virtual copy_data.
#if FSDP_TORCH_VERSION_AT_LEAST(2, 3)
#define FSDP_ALLOCATOR_CONST
#define FSDP_ALLOCATOR_HAS_COPY_DATA 1
#else
#define FSDP_ALLOCATOR_CONST const
#define FSDP_ALLOCATOR_HAS_COPY_DATA 0
#endif

#include <c10/core/TensorImpl.h>
#include <c10/util/string_utils.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace fsdp {
namespace compat {

// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl address printed as a
// string in 1.13, and by the TensorImpl pointer itself in later releases. Picks the right key
// for whichever map type `state()` returns.
template <typename StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap&, c10::TensorImpl* impl) {
  if constexpr (std::is_same<typename StateMap::key_type, std::string>::value) {
    return c10::guts::to_string(impl);
  } else {
    return impl;
  }
}

// A post hook on an autograd Node (replicate() hooks each parameter's AccumulateGrad node, the
// same hook point DDP uses). 1.13 and 2.x both have `uintptr_t Node::add_post_hook(
// std::unique_ptr<FunctionPostHook>&&)` returning the key `del_post_hook` takes, and
// `torch::autograd::impl::grad_accumulator(param)`; 2.x also offers
// Tensor::register_post_accumulate_grad_hook, and its compiled autograd refuses C++ post hooks
// that do not implement FunctionPostHook::compiled_args (eager backward runs them as 1.13 does).
// A template, so this header needs no autograd include.
template <typename Node, typename HookPtr>
uintptr_t add_post_hook(Node& node, HookPtr&& hook) {
  return node.add_post_hook(std::forward<HookPtr>(hook));
}

}  // namespace compat
}  // namespace fsdp
