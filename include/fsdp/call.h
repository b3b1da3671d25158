// fsdp/call.h — the hook point: how model code calls a submodule so that FSDP can run its
// pre-forward and post-forward around it.
//
// LibTorch modules have no forward hooks (ModuleHolder::operator() calls forward() directly),
// so fsdp-cpp asks model code to call submodules through fsdp::call:
//
//   struct BlockImpl : torch::nn::Module { ... };
//   struct NetImpl : torch::nn::Module {
//     at::Tensor forward(at::Tensor x) {
//       for (auto& block : blocks) x = fsdp::call(block, x);   // instead of block(x)
//       return fsdp::call(head, x);
//     }
//   };
//   ...
//   at::Tensor out = fsdp::call(net, x);                          // the root, from the training loop
//
// On a module that fully_shard() was not applied to, fsdp::call(m, args...) is exactly
// m->forward(args...): the same model code trains unsharded (compare PyTorch's
// register_fsdp_forward_method, a no-op on modules that are not FSDP modules). On an FSDP module
// it runs, in order: pre-forward (lazy initialisation on the root's first call; all-gather of the
// module's parameters, or waiting for a prefetched one; prefetching the next module; hooking the
// inputs for post-backward), the module's forward, and post-forward (freeing the gathered
// parameters if the module reshards after forward; hooking the outputs for pre-backward).
//
// Tensor arguments (at::Tensor) are hooked; other arguments are passed through untouched.
// The forward must return an at::Tensor, a std::vector<at::Tensor> or a std::tuple of tensors.
//
// Skipping the hook point (m->forward(x) or m(x) on an FSDP module) computes on parameters whose
// storage is freed while the module is resharded. LibTorch refuses that ("...data is not
// allocated yet..." or "...out of bounds for storage of size 0"); when such an error escapes a
// module called through fsdp::call, fsdp rethrows it naming the FSDP modules under it whose
// parameters were resharded at that moment. To run a module's forward directly on purpose,
// call unshard() on it first (and reshard() after).
#pragma once

#include <fsdp/detail/call.h>

#include <ATen/core/Tensor.h>

#include <tuple>
#include <utility>
#include <vector>

namespace fsdp {

// Calls module->forward(args...) with FSDP's hooks around it when the module is an FSDP module.
// `module` is a ModuleHolder (e.g. torch::nn::Linear) or a std::shared_ptr to a module.
// Not thread-safe with respect to other calls into the same FSDP tree.
template <typename ModulePtr, typename... Args>
auto call(ModulePtr& module, Args&&... args) -> decltype(module->forward(std::forward<Args>(args)...)) {
  using Result = decltype(module->forward(std::forward<Args>(args)...));
  detail::FSDPState* state = detail::state_of(*module);
  if (state == nullptr) return module->forward(std::forward<Args>(args)...);

  std::vector<at::Tensor> inputs = detail::pre_forward(*state, *module, detail::tensor_args(args...));
  detail::ArgSubstituter substitute{inputs};
  // A braced list evaluates left to right, so replacements are taken in argument order.
  std::tuple<decltype(substitute(std::forward<Args>(args)))...> call_args{substitute(std::forward<Args>(args))...};
  try {
    Result result = std::apply([&](auto&&... a) { return module->forward(std::forward<decltype(a)>(a)...); },
                               std::move(call_args));
    detail::run_post_forward(*state, *module, result);
    return result;
  } catch (...) {
    detail::rethrow_forward_error(*state);
  }
}

}  // namespace fsdp
