// layer: composable (what may include what: docs/architecture.md)
/// \file
/// fsdp/call.h — the hook point: how model code calls a submodule so that FSDP can run its
/// pre-forward and post-forward around it.
///
/// LibTorch modules have no forward hooks (ModuleHolder::operator() calls forward() directly),
/// so fsdp-cpp asks model code to call submodules through fsdp::call:
///
/// \code{.cpp}
///   struct BlockImpl : torch::nn::Module { ... };
///   struct NetImpl : torch::nn::Module {
///     at::Tensor forward(at::Tensor x) {
///       for (auto& block : blocks) x = fsdp::call(block, x);   // instead of block(x)
///       return fsdp::call(head, x);
///     }
///   };
///   ...
///   at::Tensor out = fsdp::call(net, x);                          // the root, from the training loop
/// \endcode
///
/// On a module that fully_shard() was not applied to, fsdp::call(m, args...) is exactly
/// m->forward(args...): the same model code trains unsharded (compare PyTorch's
/// register_fsdp_forward_method, a no-op on modules that are not FSDP modules). On an FSDP module
/// it runs, in order: pre-forward (lazy initialisation on the root's first call; on the root of a
/// "cuda" mesh, moving tensor arguments that are elsewhere to the mesh's GPU, as FSDP2 does, with a
/// copy that blocks the host; all-gather of the module's parameters, or waiting for a prefetched
/// one; prefetching the next module; hooking the inputs for post-backward), the module's forward,
/// and post-forward (freeing the gathered parameters if the module reshards after forward; hooking
/// the outputs for pre-backward).
///
/// Tensor arguments (at::Tensor) are hooked; other arguments are passed through untouched.
/// The forward must return an at::Tensor, a `std::vector<at::Tensor>` or a std::tuple of tensors.
///
/// Skipping the hook point (m->forward(x) or m(x) on an FSDP module) computes on parameters whose
/// storage is freed while the module is resharded. LibTorch refuses that ("...data is not
/// allocated yet..." or "...out of bounds for storage of size 0"); when such an error escapes a
/// module called through fsdp::call, fsdp rethrows it naming the FSDP modules under it whose
/// parameters were resharded at that moment. To run a module's forward directly on purpose,
/// call unshard() on it first (and reshard() after).
///
/// LibTorch's containers. torch::nn::Sequential's forward calls its children itself (through
/// AnyModule), past any hook point, so call the Sequential through fsdp::call: it runs the
/// Sequential's own hooks (when it is an FSDP module) and calls each child through fsdp::call,
/// passing each child's output to the next exactly as Sequential::forward does:
///
/// \code{.cpp}
///   torch::nn::Sequential seq(torch::nn::Linear(5, 7), torch::nn::ReLU(), torch::nn::Linear(7, 1));
///   for (auto& child : seq->children()) {
///     if (child->parameters(false).size() > 0) fsdp::fully_shard(child);
///   }
///   fsdp::fully_shard(seq.ptr());                   // the root, last
///   at::Tensor y = fsdp::call(seq, x);              // not seq(x) or seq->forward(x)
///   auto pair = fsdp::call<std::vector<at::Tensor>>(seq, x);   // like seq->forward<T>(x)
/// \endcode
///
/// The Sequential may be given as its holder, a std::shared_ptr or a raw pointer to
/// SequentialImpl. A class derived from SequentialImpl has a forward of its own, which fsdp::call
/// runs; it should call fsdp::sequential_forward (below) instead of SequentialImpl::forward. An
/// FSDP child of a Sequential must return at::Tensor or `std::vector<at::Tensor>` (its
/// backward is hooked on them); the tensor a child receives from the previous child is hooked as
/// a tensor argument. A Sequential's children that are not FSDP modules run exactly as in
/// Sequential::forward.
///
/// torch::nn::ModuleList and ModuleDict have no forward: the model's code calls their elements,
/// and does so through fsdp::call with a typed pointer to the element (the containers hand out
/// `std::shared_ptr<Module>`, which has no forward of its own):
///
/// \code{.cpp}
///   for (size_t i = 0; i < blocks->size(); ++i) h = fsdp::call(blocks->ptr<BlockImpl>(i), h);
///   h = fsdp::call(blocks[i]->as<BlockImpl>(), h);                  // a raw pointer works too
///   h = fsdp::call(experts[name]->as<ExpertImpl>(), h);             // ModuleDict
/// \endcode
///
/// fully_shard each element (and the module that owns the container); fully_shard of a
/// ModuleList or ModuleDict itself is refused, as in PyTorch, since nothing would call its hooks.
#pragma once

#include <fsdp/detail/call.h>

#include <ATen/core/Tensor.h>

#include <tuple>
#include <utility>
#include <vector>

namespace fsdp {

namespace detail {

/// The body of fsdp::call and fsdp::call_method: `invoke(args...)` runs the module's entry point;
/// around it pre-forward and post-forward when the module is an FSDP module. An exception from
/// the entry point or the hooks goes to the hooks' rethrow_forward_error (for FSDP: the iteration
/// is left unfinished, and the next forward refuses to start until FSDPModule::reset_iter_state()
/// is called on the root).
template <typename Result, typename ModulePtr, typename Invoke, typename... Args>
Result call_with_hooks(ModulePtr& module, Invoke invoke, Args&&... args) {
  ForwardHooks* hooks = forward_hooks_of(*module);
  if (hooks == nullptr) return invoke(std::forward<Args>(args)...);

  std::vector<at::Tensor> inputs;
  try {
    inputs = hooks->pre_forward(*module, tensor_args(args...));
  } catch (...) {
    rethrow_forward_error(*hooks);
  }
  ArgSubstituter substitute{inputs};
  // A braced list evaluates left to right, so replacements are taken in argument order.
  std::tuple<decltype(substitute(std::forward<Args>(args)))...> call_args{substitute(std::forward<Args>(args))...};
  try {
    Result result = std::apply(invoke, std::move(call_args));
    run_post_forward(*hooks, *module, result);
    return result;
  } catch (...) {
    rethrow_forward_error(*hooks);
  }
}

/// One child of a Sequential (its AnyModule), with hooks.
template <typename... Args>
torch::nn::AnyValue call_sequential_child(torch::nn::AnyModule& child, Args&&... args) {
  std::shared_ptr<torch::nn::Module> module = child.ptr();
  return call_with_hooks<torch::nn::AnyValue>(
      module, [&child](auto&&... a) { return child.any_forward(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

}  // namespace detail

/// `Sequential::forward<ReturnType>(args...)` with each child called through the hook point, and
/// no hooks of the Sequential's own: for the forward of a class derived from SequentialImpl (a
/// Sequential that can be a child of another one, which LibTorch requires to have a
/// non-templated forward), in place of SequentialImpl::forward:
///
/// \code{.cpp}
///   struct StackImpl : torch::nn::SequentialImpl {
///     using SequentialImpl::SequentialImpl;
///     at::Tensor forward(at::Tensor x) { return fsdp::sequential_forward(*this, x); }
///   };
/// \endcode
///
/// Such a class is called like any module, fsdp::call(stack, x), which runs its forward (and its
/// hooks if it is an FSDP module).
template <typename ReturnType = at::Tensor, typename... Args>
ReturnType sequential_forward(torch::nn::SequentialImpl& sequential, Args&&... args) {
  TORCH_CHECK(!sequential.is_empty(), "Cannot call forward() on an empty Sequential");
  auto it = sequential.begin();
  torch::nn::AnyValue value = detail::call_sequential_child(*it, std::forward<Args>(args)...);
  for (++it; it != sequential.end(); ++it) value = detail::call_sequential_child(*it, std::move(value));
  if (auto* result = value.template try_get<ReturnType>()) return std::move(*result);
  detail::throw_sequential_result_type(value.type_info(), typeid(ReturnType));
}

/// Calls module->forward(args...) with FSDP's hooks around it when the module is an FSDP module.
/// `module` is a ModuleHolder (e.g. torch::nn::Linear), a std::shared_ptr to a module or a raw
/// pointer to one (e.g. from a ModuleList: `list->ptr<BlockImpl>(i)`, `list[i]->as<BlockImpl>()`).
/// Not thread-safe with respect to other calls into the same FSDP tree.
template <typename ModulePtr, typename... Args>
auto call(ModulePtr&& module, Args&&... args)
    -> std::enable_if_t<!detail::is_sequential<ModulePtr>::value,
                        decltype(module->forward(std::forward<Args>(args)...))> {
  using Result = decltype(module->forward(std::forward<Args>(args)...));
  return detail::call_with_hooks<Result>(
      module, [&module](auto&&... a) -> Result { return module->forward(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

/// fsdp::call for a torch::nn::Sequential (see the top of this header): the Sequential's hooks
/// around its children's, each child called through fsdp::call. ReturnType is what
/// `Sequential::forward<ReturnType>` would return (at::Tensor, `std::vector<at::Tensor>` or a tuple
/// of tensors); a different type from the last child is LibTorch's error.
template <typename ReturnType = at::Tensor, typename SequentialPtr, typename... Args>
auto call(SequentialPtr&& sequential, Args&&... args)
    -> std::enable_if_t<detail::is_sequential<SequentialPtr>::value, ReturnType> {
  return detail::call_with_hooks<ReturnType>(
      sequential,
      [&sequential](auto&&... a) -> ReturnType {
        return sequential_forward<ReturnType>(*sequential, std::forward<decltype(a)>(a)...);
      },
      std::forward<Args>(args)...);
}

/// fsdp::call for an entry point other than forward (PyTorch's register_fsdp_forward_method):
/// calls (*module.*method)(args...) with the same pre-forward and post-forward around it, so that
/// a module may offer several methods that each act as its forward for FSDP (lazy
/// initialisation, all-gather, hooks on the inputs and outputs). `method` is a pointer to a
/// member function of the module's class, named with all its parameters (no defaults):
/// \code{.cpp}
///   at::Tensor loss = fsdp::call_method(model, &fsdp::models::TransformerImpl::forward_loss,
///                                       tokens, targets, int64_t{8});
/// \endcode
/// A parent calls a child's method the same way: fsdp::call_method(encoder, &EncoderImpl::forward_features, x).
/// On a module that fully_shard() was not applied to, it is exactly the member call.
template <typename ModulePtr, typename Method, typename... Args>
auto call_method(ModulePtr&& module, Method method, Args&&... args)
    -> decltype(((*module).*method)(std::forward<Args>(args)...)) {
  using Result = decltype(((*module).*method)(std::forward<Args>(args)...));
  return detail::call_with_hooks<Result>(
      module, [&module, method](auto&&... a) -> Result { return ((*module).*method)(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

/// fsdp::call for a computation that uses a module's parameters without being one of its
/// methods, e.g. a fused output-head-and-loss function that reads head->weight:
/// \code{.cpp}
///   at::Tensor loss = fsdp::call_as_forward(
///       output, [&](const at::Tensor& x, const at::Tensor& t) { return fused_loss(x, output->weight, t); }, h, targets);
/// \endcode
/// runs fn(args...) with the module's pre-forward and post-forward around it, exactly as
/// fsdp::call runs forward: an FSDP module's parameters are gathered for fn, the tensor
/// arguments that need grad are hooked for post-backward and the results for pre-backward. fn must
/// compute from the arguments it is given (they are replaced by their hooked versions), not from
/// tensors it captured, or post-backward never runs for it. On a module that fully_shard() was not
/// applied to, it is exactly fn(args...).
template <typename ModulePtr, typename Fn, typename... Args>
auto call_as_forward(ModulePtr&& module, Fn&& fn, Args&&... args) -> decltype(fn(std::forward<Args>(args)...)) {
  using Result = decltype(fn(std::forward<Args>(args)...));
  return detail::call_with_hooks<Result>(
      module, [&fn](auto&&... a) -> Result { return fn(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
}

}  // namespace fsdp
