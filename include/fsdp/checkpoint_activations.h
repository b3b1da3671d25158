// layer: autograd (what may include what: docs/architecture.md)
/// \file
/// fsdp/checkpoint_activations.h — activation checkpointing: run a function or a module without
/// keeping the activations it computes, and compute them again in backward. (Saving training
/// state to disk is fsdp/checkpoint.h; nothing here touches files.)
///
/// \code{.cpp}
///   // Any callable: only `x` is kept for backward, not gelu(x) or the product.
///   at::Tensor y = fsdp::checkpoint([](const at::Tensor& x, double s) { return at::gelu(x) * s; }, x, 0.5);
///
///   // A module, called like fsdp::call (the hook point), so model code picks checkpointing per call:
///   for (auto& block : blocks) h = checkpointed ? fsdp::call_checkpointed(block, h) : fsdp::call(block, h);
///   h = fsdp::call_checkpointed(fsdp::CheckpointOptions().preserve_rng_state(false), block, h);
/// \endcode
///
/// What happens (PyTorch's torch.utils.checkpoint with use_reentrant=True):
///  - Forward runs fn(args...) under no-grad, inside a custom autograd function whose inputs are
///    the tensor arguments: only those are saved (and the generators' states, see
///    preserve_rng_state), so the memory of fn's intermediates is freed as soon as fn returns.
///  - Backward, when the gradient of the outputs arrives, calls fn again with grad enabled on
///    detached copies of the saved inputs, backpropagates through that recomputation (a nested
///    backward), and hands the inputs' gradients on. Parameters used by fn get their gradients
///    in that nested backward, accumulated into .grad as usual.
///  - With FSDP: fn may call FSDP modules (call_checkpointed(block, x) calls fsdp::call(block, x)).
///    Their forward runs as usual (all-gather, forward, reshard after forward). In the
///    recomputation each group is all-gathered once (or takes the all-gather the backward
///    prefetch already issued; nothing when it did not reshard after forward) and stays gathered
///    through its recomputed backward; the recomputed graph is hooked for pre- and post-backward,
///    so the group reduce-scatters when that backward is done, as in any backward. So a model
///    checkpointed per block issues the collectives it issues without checkpointing. The
///    recomputation is not a new forward for FSDP: no root forward, no forward prefetch, no
///    reshard after it, and the end-of-backward work runs once, at the end of the outer backward.
///    A group whose modules are split over several checkpoints (fully_shard({a, b}) with a and b
///    checkpointed apart) reduce-scatters once per recomputation; the parts add up.
///
/// Requirements, as in PyTorch:
///  - fn must compute the same thing when called again: same modules, same shapes, same control
///    flow (random ops reproduce only with preserve_rng_state). It is called again during
///    backward, so everything it refers to must still be alive then; fn and the non-tensor
///    arguments are copied (fn must be copy-constructible), tensor arguments are saved.
///  - At least one tensor argument must require grad, or nothing is recorded: the outputs do not
///    require grad, and parameters inside fn get no gradient (a warning says so once).
///  - Backward through a checkpoint must be a plain backward(): torch::autograd::grad() or
///    backward with `inputs` is refused (the nested backward accumulates into every leaf's .grad).
///  - The result of fn is an at::Tensor, a `std::vector<at::Tensor>` or a std::tuple of tensors, every
///    one defined. Tensor arguments are fn's inputs for autograd; other arguments pass through.
///  - Under no-grad (evaluation), checkpoint(fn, args...) is just fn(args...).
///
/// Not collective by itself; if fn calls FSDP modules, every rank must checkpoint the same calls
/// (their all-gathers and reduce-scatters are collective). Not thread-safe with respect to other
/// calls into the same FSDP tree. Recomputation and its nested backward run on the thread of the
/// outer backward.
#pragma once

#include <fsdp/call.h>
#include <fsdp/detail/call.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

/// The options of activation checkpointing (call_checkpointed, checkpoint).
struct CheckpointOptions {
  /// Recompute by calling the function again inside backward and backpropagating through the
  /// recomputation (PyTorch's use_reentrant=True). false (PyTorch's saved-tensor-hooks variant) is
  /// supported yet: LibTorch's C++ API (2.15 included) has no default saved-tensor hooks
  /// (at::SavedTensorDefaultHooks holds Python callables, and only Python's autograd engine
  /// consults them), so checkpoint() with use_reentrant(false) throws a c10::Error saying so.
  TORCH_ARG(bool, use_reentrant) = true;
  /// Save the default generators' states when the forward starts (the CPU's, and the default
  /// generator of every GPU a tensor argument lives on, as torch.utils.checkpoint does) and restore
  /// them for the recomputation, so random ops (dropout) draw what the forward drew; they are put back
  /// afterwards, so the rest of the program sees the same random sequence as without
  /// checkpointing. false saves nothing: random ops in the recomputation draw new values (a
  /// dropout mask unlike the forward's) and advance the generator.
  TORCH_ARG(bool, preserve_rng_state) = true;
};

namespace detail {

/// The checkpointed function, type-erased: called with the tensor arguments in order (undefined
/// ones stay undefined), returns every tensor of its result in order.
using CheckpointedFunction = std::function<std::vector<at::Tensor>(std::vector<at::Tensor>)>;

/// Runs `function` on `inputs` under no-grad inside the checkpoint's autograd function and returns
/// its outputs, attached to the graph (checkpoint_activations.cpp).
std::vector<at::Tensor> run_checkpointed(const CheckpointOptions& options, CheckpointedFunction function,
                                         std::vector<at::Tensor> inputs);
/// Throws c10::Error for options that cannot run (use_reentrant(false)), saying why.
void check_checkpoint_options(const CheckpointOptions& options);
/// Checks the options and says whether a checkpoint would record anything: grad mode is on.
/// Otherwise fn simply runs.
bool checkpoint_records_graph(const CheckpointOptions& options);

template <typename T>
void clear_if_tensor(T& arg) {
  if constexpr (is_tensor<T>::value) arg = at::Tensor();
}

template <typename Result>
std::vector<at::Tensor> tensors_of(Result& result) {
  std::vector<at::Tensor*> slots;
  collect(result, slots);
  std::vector<at::Tensor> tensors;
  tensors.reserve(slots.size());
  for (auto* s : slots) tensors.push_back(*s);
  return tensors;
}

template <typename Result>
void replace_tensors(Result& result, const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor*> slots;
  collect(result, slots);
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = tensors[i];
}

template <typename T>
using is_checkpoint_options = std::is_same<std::decay_t<T>, CheckpointOptions>;

}  // namespace detail

/// Runs fn(args...) without keeping its activations; backward recomputes them (see the top of
/// this file). Returns what fn returns, its tensors attached to the graph. Does not block beyond
/// what fn does; allocates a copy of fn, of the non-tensor arguments and of the generators'
/// states (about 5 KiB for the CPU's, a few bytes per GPU's), kept until the graph is freed.
template <typename Fn, typename... Args>
auto checkpoint(const CheckpointOptions& options, Fn&& fn, Args&&... args)
    -> std::decay_t<std::invoke_result_t<std::decay_t<Fn>&, std::decay_t<Args>&...>> {
  using Result = std::decay_t<std::invoke_result_t<std::decay_t<Fn>&, std::decay_t<Args>&...>>;
  if (!detail::checkpoint_records_graph(options)) return fn(args...);  // lvalues, as in the recomputation

  std::vector<at::Tensor> inputs = detail::tensor_args(args...);
  // Non-tensor arguments are kept for the recomputation; tensors are saved by the autograd
  // function instead, so the closure holds none.
  std::tuple<std::decay_t<Args>...> kept{args...};
  std::apply([](auto&... a) { (detail::clear_if_tensor(a), ...); }, kept);
  // The forward's result, whose structure (vector length, tuple) the outputs are put back into.
  auto forward_result = std::make_shared<std::optional<Result>>();
  detail::CheckpointedFunction function = [fn = std::decay_t<Fn>(std::forward<Fn>(fn)), kept = std::move(kept),
                                           forward_result, first_run = true](std::vector<at::Tensor> tensors) mutable {
    detail::ArgSubstituter substitute{tensors};
    // A braced list evaluates left to right, so tensors are taken in argument order.
    std::tuple<std::decay_t<Args>...> call_args =
        std::apply([&](auto&... a) { return std::tuple<std::decay_t<Args>...>{substitute(a)...}; }, kept);
    Result result = std::apply(fn, call_args);
    std::vector<at::Tensor> outputs = detail::tensors_of(result);
    if (first_run) forward_result->emplace(std::move(result));
    first_run = false;
    return outputs;
  };
  std::vector<at::Tensor> outputs = detail::run_checkpointed(options, std::move(function), std::move(inputs));
  Result result = std::move(**forward_result);
  forward_result->reset();
  detail::replace_tensors(result, outputs);
  return result;
}

/// checkpoint() with the default options (reentrant, RNG state preserved).
template <typename Fn, typename... Args, typename = std::enable_if_t<!detail::is_checkpoint_options<Fn>::value>>
auto checkpoint(Fn&& fn, Args&&... args) {
  return checkpoint(CheckpointOptions(), std::forward<Fn>(fn), std::forward<Args>(args)...);
}

/// fsdp::call(module, args...) without keeping the module's activations: exactly
/// checkpoint(options, fn, args...) with fn calling fsdp::call on the module, so an FSDP module's
/// hooks run in the forward and again in the recomputation. `module` (a ModuleHolder or a
/// std::shared_ptr) is copied, which keeps the module alive until the recomputation.
template <typename ModulePtr, typename... Args>
auto call_checkpointed(const CheckpointOptions& options, ModulePtr& module, Args&&... args) {
  return checkpoint(
      options, [module](auto&... a) mutable { return fsdp::call(module, a...); }, std::forward<Args>(args)...);
}

/// call_checkpointed() with the default options.
template <typename ModulePtr, typename... Args,
          typename = std::enable_if_t<!detail::is_checkpoint_options<ModulePtr>::value>>
auto call_checkpointed(ModulePtr& module, Args&&... args) {
  return call_checkpointed(CheckpointOptions(), module, std::forward<Args>(args)...);
}

}  // namespace fsdp
