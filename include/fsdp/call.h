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

namespace detail {

// The body of fsdp::call and fsdp::call_method: `invoke(args...)` runs the module's entry point;
// around it pre-forward and post-forward when the module is an FSDP module.
template <typename Result, typename ModulePtr, typename Invoke, typename... Args>
Result call_with_hooks(ModulePtr& module, Invoke invoke, Args&&... args) {
  FSDPState* state = state_of(*module);
  if (state == nullptr) return invoke(std::forward<Args>(args)...);

  std::vector<at::Tensor> inputs = pre_forward(*state, *module, tensor_args(args...));
  ArgSubstituter substitute{inputs};
  // A braced list evaluates left to right, so replacements are taken in argument order.
  std::tuple<decltype(substitute(std::forward<Args>(args)))...> call_args{substitute(std::forward<Args>(args))...};
  try {
    Result result = std::apply(invoke, std::move(call_args));
    run_post_forward(*state, *module, result);
    return result;
  } catch (...) {
    rethrow_forward_error(*state);
  }
}

}  // namespace detail

// Calls module->forward(args...) with FSDP's hooks around it when the module is an FSDP module.
// `module` is a ModuleHolder (e.g. torch::nn::Linear) or a std::shared_ptr to a module.
// Not thread-safe with respect to other calls into the same FSDP tree.
template <typename ModulePtr, typename... Args>
auto call(ModulePtr& module, Args&&... args) -> decltype(module->forward(std::forward<Args>(args)...)) {
  using Result = decltype(module->forward(std::forward<Args>(args)...));
  return detail::call_with_hooks<Result>(
      module, [&module](auto&&... a) -> Result { return module->forward(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

// fsdp::call for an entry point other than forward (PyTorch's register_fsdp_forward_method):
// calls (*module.*method)(args...) with the same pre-forward and post-forward around it, so that
// a module may offer several methods that each act as its forward for FSDP (lazy
// initialisation, all-gather, hooks on the inputs and outputs). `method` is a pointer to a
// member function of the module's class, named with all its parameters (no defaults):
//   at::Tensor loss = fsdp::call_method(model, &fsdp::models::TransformerImpl::forward_loss,
//                                       tokens, targets, int64_t{8});
// On a module that fully_shard() was not applied to, it is exactly the member call.
template <typename ModulePtr, typename Method, typename... Args>
auto call_method(ModulePtr& module, Method method, Args&&... args)
    -> decltype(((*module).*method)(std::forward<Args>(args)...)) {
  using Result = decltype(((*module).*method)(std::forward<Args>(args)...));
  return detail::call_with_hooks<Result>(
      module, [&module, method](auto&&... a) -> Result { return ((*module).*method)(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

}  // namespace fsdp
