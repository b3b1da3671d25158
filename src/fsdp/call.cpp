// call.cpp — the hook point's entry points (fsdp/detail/call.h): fsdp::call finds the module's
// state, runs its pre-forward and post-forward, and turns LibTorch's error about freed storage
// into one that names the resharded FSDP modules.
#include <fsdp/call.h>

#include "src/fsdp/state.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include <string>

namespace fsdp {
namespace detail {

FSDPState* state_of(const torch::nn::Module& module) { return find_state(module).get(); }

std::vector<at::Tensor> pre_forward(FSDPState& state, const torch::nn::Module& module, std::vector<at::Tensor> inputs) {
  return state.pre_forward(module, std::move(inputs));
}

void post_forward(FSDPState& state, const torch::nn::Module& module, std::vector<at::Tensor>& outputs) {
  state.post_forward(module, outputs);
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

void run_post_forward(FSDPState& state, const torch::nn::Module& module, torch::nn::AnyValue& result) {
  if (auto* t = result.try_get<at::Tensor>()) {
    run_post_forward(state, module, *t);
  } else if (auto* v = result.try_get<std::vector<at::Tensor>>()) {
    run_post_forward(state, module, *v);
  } else {
    TORCH_CHECK(false, "fsdp::call: the FSDP module '", module.name(), "' in a torch::nn::Sequential returned a ",
                c10::demangle(result.type_info().name()), "; an FSDP child of a Sequential must return at::Tensor or "
                "std::vector<at::Tensor>, so that its backward can be hooked. Call it from a module of your own "
                "through fsdp::call instead.");
  }
}

void throw_sequential_result_type(const std::type_info& actual, const std::type_info& requested) {
  TORCH_CHECK(false, "The type of the return value is ", c10::demangle(actual.name()), ", but you asked for type ",
              c10::demangle(requested.name()));
}

void rethrow_forward_error(FSDPState& state) {
  state.mark_iteration_failed();
  try {
    throw;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    const bool freed_storage = msg.find("data is not allocated yet") != std::string::npos ||
                               msg.find("storage of size 0") != std::string::npos;
    const auto resharded = state.resharded_modules_below();
    if (!freed_storage || resharded.empty()) throw;
    std::string names;
    for (const auto& n : resharded) names += (names.empty() ? "'" : ", '") + n + "'";
    TORCH_CHECK(false, "fsdp: a module computed on resharded (freed) parameters. At that moment these FSDP modules "
                "were resharded: ", names, ". Call FSDP modules through fsdp::call(module, ...) instead of "
                "module->forward(...) or module(...), or unshard() them first. LibTorch said: ", msg);
  }
}

}  // namespace detail
}  // namespace fsdp
