// call.cpp — the hook point's entry points (fsdp/detail/call.h): finding a module's forward
// hooks in the composable registry, and the pieces of fsdp::call for torch::nn::Sequential.
#include <fsdp/call.h>

#include "src/composable/registry.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

namespace fsdp {
namespace detail {

ForwardHooks* forward_hooks_of(const torch::nn::Module& module) {
  auto managed = composable::managed_module(module);
  // The registry keeps the state alive while the module lives, so the pointer outlives the call.
  return managed ? managed->state->forward_hooks() : nullptr;
}

void rethrow_forward_error(ForwardHooks& hooks) {
  hooks.rethrow_forward_error();
  throw;  // a ForwardHooks that returned: the exception in flight goes on unchanged
}

// Tensors travel between a Sequential's children as AnyValue; an at::Tensor is hooked like a
// tensor argument of fsdp::call, anything else passes through.
void push_any_value_tensors(std::vector<at::Tensor>& out, const torch::nn::AnyValue& value) {
  // try_get only reads; LibTorch declares it non-const.
  if (auto* t = const_cast<torch::nn::AnyValue&>(value).try_get<at::Tensor>()) out.push_back(*t);
}

torch::nn::AnyValue substitute_any_value(torch::nn::AnyValue value, const std::vector<at::Tensor>& replacements,
                                         size_t& next) {
  if (value.try_get<at::Tensor>() == nullptr) return value;
  return torch::nn::AnyValue(at::Tensor(replacements.at(next++)));
}

void run_post_forward(ForwardHooks& hooks, const torch::nn::Module& module, torch::nn::AnyValue& result) {
  if (auto* t = result.try_get<at::Tensor>()) {
    run_post_forward(hooks, module, *t);
  } else if (auto* v = result.try_get<std::vector<at::Tensor>>()) {
    run_post_forward(hooks, module, *v);
  } else {
    TORCH_CHECK(false, "fsdp::call: the FSDP module '", module.name(), "' in a torch::nn::Sequential returned a ",
                c10::demangle(result.type_info().name()),
                "; an FSDP child of a Sequential must return at::Tensor or "
                "std::vector<at::Tensor>, so that its backward can be hooked. Call it from a module of your own "
                "through fsdp::call instead.");
  }
}

void throw_sequential_result_type(const std::type_info& actual, const std::type_info& requested) {
  TORCH_CHECK(false, "The type of the return value is ", c10::demangle(actual.name()), ", but you asked for type ",
              c10::demangle(requested.name()));
}

}  // namespace detail
}  // namespace fsdp
