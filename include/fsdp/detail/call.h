// fsdp/detail/call.h — the machinery behind fsdp::call (fsdp/call.h): the hook entry points it
// calls and the templates that pick tensors out of its arguments and results. Not an API:
// include <fsdp/call.h>; names here may change between releases.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {
namespace detail {

class FSDPState;

// The FSDP state of a module that fully_shard() was applied to, or nullptr. Cheap (one lookup).
FSDPState* state_of(const torch::nn::Module& module);
// Runs pre-forward; returns the inputs to use instead (inputs that need grad are wrapped so that
// their gradient triggers post-backward).
std::vector<at::Tensor> pre_forward(FSDPState& state, const torch::nn::Module& module, std::vector<at::Tensor> inputs);
// Runs post-forward; hooks outputs that need grad for pre-backward (they are replaced in place).
void post_forward(FSDPState& state, const torch::nn::Module& module, std::vector<at::Tensor>& outputs);
// Rethrows an error that escaped the module's forward, naming resharded FSDP modules if the error
// is LibTorch refusing to compute on freed storage. Never returns.
[[noreturn]] void rethrow_forward_error(FSDPState& state);

template <typename T>
using is_tensor = std::is_same<std::decay_t<T>, at::Tensor>;

template <typename T>
void push_if_tensor(std::vector<at::Tensor>& out, const T& arg) {
  if constexpr (is_tensor<T>::value) out.push_back(arg);
}

// Collects the at::Tensor arguments, in order.
template <typename... Args>
std::vector<at::Tensor> tensor_args(const Args&... args) {
  std::vector<at::Tensor> out;
  (push_if_tensor(out, args), ...);
  return out;
}

// Returns the next replacement for a tensor argument, the argument itself otherwise.
struct ArgSubstituter {
  std::vector<at::Tensor>& replacements;
  size_t next = 0;
  template <typename T>
  decltype(auto) operator()(T&& arg) {
    if constexpr (is_tensor<T>::value) {
      return at::Tensor(replacements[next++]);
    } else {
      return std::forward<T>(arg);
    }
  }
};

// Output flattening for post-forward: tensors out, then back in.
inline void collect(at::Tensor& t, std::vector<at::Tensor*>& out) { out.push_back(&t); }
inline void collect(std::vector<at::Tensor>& v, std::vector<at::Tensor*>& out) {
  for (auto& t : v) out.push_back(&t);
}
template <typename... Ts>
void collect(std::tuple<Ts...>& tup, std::vector<at::Tensor*>& out) {
  std::apply([&](auto&... elems) { (collect(elems, out), ...); }, tup);
}

template <typename Result>
void run_post_forward(FSDPState& state, const torch::nn::Module& module, Result& result) {
  std::vector<at::Tensor*> slots;
  collect(result, slots);
  std::vector<at::Tensor> outputs;
  outputs.reserve(slots.size());
  for (auto* s : slots) outputs.push_back(*s);
  post_forward(state, module, outputs);
  for (size_t i = 0; i < slots.size(); ++i) *slots[i] = outputs[i];
}

}  // namespace detail
}  // namespace fsdp
