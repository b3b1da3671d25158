// layer: composable (what may include what: docs/architecture.md)
/// \file
/// fsdp/detail/call.h — the machinery behind fsdp::call (fsdp/call.h): the hook entry points it
/// calls and the templates that pick tensors out of its arguments and results. Not an API:
/// include `<fsdp/call.h>`; names here may change between releases.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {
namespace detail {

/// What an API that manages a module (fully_shard) runs around the module's forward when model
/// code calls it through fsdp::call. The API's state implements it and registers with the
/// composable registry (src/composable/registry.h); the hook point knows no API.
class ForwardHooks {
 public:
  virtual ~ForwardHooks() = default;
  /// Runs before the forward; returns the inputs to use instead (e.g. inputs that need grad
  /// wrapped so that their gradient triggers the API's post-backward).
  virtual std::vector<at::Tensor> pre_forward(const torch::nn::Module& module, std::vector<at::Tensor> inputs) = 0;
  /// Runs after the forward; may replace outputs in place (e.g. hooked for pre-backward).
  virtual void post_forward(const torch::nn::Module& module, std::vector<at::Tensor>& outputs) = 0;
  /// Called inside a catch block, with the exception that escaped the forward or a hook in
  /// flight: records it and rethrows it, or a clearer error in its place. Never returns.
  [[noreturn]] virtual void rethrow_forward_error() = 0;
};

/// The forward hooks of `module`, or nullptr when no API hooks it. Cheap (one lookup).
ForwardHooks* forward_hooks_of(const torch::nn::Module& module);
/// hooks.rethrow_forward_error(), from a catch block, known to the compiler never to return.
[[noreturn]] void rethrow_forward_error(ForwardHooks& hooks);

/// The forms of fsdp::call for torch::nn::Sequential (fsdp/call.h): each child is called with
/// hooks, its input and output passed along as LibTorch's AnyValue.
/// The tensors of an AnyValue argument (a child's input: the previous child's output).
void push_any_value_tensors(std::vector<at::Tensor>& out, const torch::nn::AnyValue& value);
/// `value` with its tensor replaced by the next of `replacements` (pre-forward's result).
torch::nn::AnyValue substitute_any_value(torch::nn::AnyValue value, const std::vector<at::Tensor>& replacements,
                                         size_t& next);
/// Post-forward for a child of a Sequential: hooks the at::Tensor or `std::vector<at::Tensor>` it
/// returned; any other type from a hooked module is an error (its backward could not be hooked).
void run_post_forward(ForwardHooks& hooks, const torch::nn::Module& module, torch::nn::AnyValue& result);
/// The Sequential's result as `ReturnType`, or LibTorch's error for a mismatch.
[[noreturn]] void throw_sequential_result_type(const std::type_info& actual, const std::type_info& requested);

template <typename T>
using is_any_value = std::is_same<std::decay_t<T>, torch::nn::AnyValue>;

/// A handle (ModuleHolder, shared_ptr or raw pointer) to a torch::nn::SequentialImpl itself: a
/// derived class has a forward of its own (see fsdp::sequential_forward).
template <typename T, typename = void>
struct is_sequential : std::false_type {};
template <typename T>
struct is_sequential<T, std::void_t<decltype(*std::declval<T&>())>>
    : std::is_same<torch::nn::SequentialImpl, std::decay_t<decltype(*std::declval<T&>())>> {};

template <typename T>
using is_tensor = std::is_same<std::decay_t<T>, at::Tensor>;

template <typename T>
void push_if_tensor(std::vector<at::Tensor>& out, const T& arg) {
  if constexpr (is_tensor<T>::value) {
    out.push_back(arg);
  } else if constexpr (is_any_value<T>::value) {
    push_any_value_tensors(out, arg);
  }
}

/// Collects the at::Tensor arguments, in order.
template <typename... Args>
std::vector<at::Tensor> tensor_args(const Args&... args) {
  std::vector<at::Tensor> out;
  (push_if_tensor(out, args), ...);
  return out;
}

/// Returns the next replacement for a tensor argument, the argument itself otherwise.
struct ArgSubstituter {
  std::vector<at::Tensor>& replacements;
  size_t next = 0;
  template <typename T>
  decltype(auto) operator()(T&& arg) {
    if constexpr (is_tensor<T>::value) {
      return at::Tensor(replacements[next++]);
    } else if constexpr (is_any_value<T>::value) {
      // Never AnyValue(std::forward<T>(arg)) for an lvalue: its converting constructor would
      // wrap the AnyValue in another one.
      if constexpr (std::is_rvalue_reference<T&&>::value) {
        return substitute_any_value(std::forward<T>(arg), replacements, next);  // an rvalue here
      } else {
        return substitute_any_value(torch::nn::AnyValue(static_cast<const torch::nn::AnyValue&>(arg)), replacements,
                                    next);
      }
    } else {
      return std::forward<T>(arg);
    }
  }
};

/// Output flattening for post-forward: tensors out, then back in.
inline void collect(at::Tensor& t, std::vector<at::Tensor*>& out) { out.push_back(&t); }
inline void collect(std::vector<at::Tensor>& v, std::vector<at::Tensor*>& out) {
  for (auto& t : v) out.push_back(&t);
}
template <typename... Ts>
void collect(std::tuple<Ts...>& tup, std::vector<at::Tensor*>& out) {
  std::apply([&](auto&... elems) { (collect(elems, out), ...); }, tup);
}

template <typename Result>
void run_post_forward(ForwardHooks& hooks, const torch::nn::Module& module, Result& result) {
  std::vector<at::Tensor*> slots;
  collect(result, slots);
  std::vector<at::Tensor> outputs;
  outputs.reserve(slots.size());
  for (auto* s : slots) outputs.push_back(*s);
  hooks.post_forward(module, outputs);
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = outputs[i];
}

}  // namespace detail
}  // namespace fsdp
