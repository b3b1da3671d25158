// compat.h — every difference between the LibTorch versions fsdp-cpp builds against lives
// here, and nowhere else.
//
// Supported: LibTorch 2.11 (the oldest checked: scripts/check-torch-version.sh compiles the
// library against its headers) to 2.15 (the pinned wheel, scripts/torch-env.sh), with or without
// CUDA. Within that range none of the APIs fsdp-cpp uses has changed, so this header holds the
// version gate and the two helpers whose form other releases changed before; code elsewhere uses
// them instead of testing versions itself.
#pragma once

#include <torch/version.h>

#include <cstdint>
#include <utility>

// True when the LibTorch being compiled against is at least major.minor.
#define FSDP_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !FSDP_TORCH_VERSION_AT_LEAST(2, 11)
#error "fsdp-cpp needs LibTorch 2.11 or newer (scripts/install-deps.sh installs the pinned one)"
#endif

namespace c10 {
struct TensorImpl;
}

namespace fsdp {
namespace compat {

// The key of a parameter's entry in torch::optim::Optimizer::state(): the parameter's TensorImpl
// pointer (a void* in the map). One place says so, for the optimizers and state dicts that look
// entries up.
template <typename StateMap>
typename StateMap::key_type optimizer_state_key(const StateMap&, c10::TensorImpl* impl) {
  return impl;
}

// A post hook on an autograd Node (replicate() hooks each parameter's AccumulateGrad node, the
// same hook point DDP uses): `uintptr_t Node::add_post_hook(std::unique_ptr<FunctionPostHook>&&)`
// returns the key `del_post_hook` takes. Eager backward runs such hooks; compiled autograd
// refuses C++ post hooks that do not implement FunctionPostHook::compiled_args, and fsdp-cpp does
// not run under it. A template, so this header needs no autograd include.
template <typename Node, typename HookPtr>
uintptr_t add_post_hook(Node& node, HookPtr&& hook) {
  return node.add_post_hook(std::forward<HookPtr>(hook));
}

}  // namespace compat
}  // namespace fsdp
