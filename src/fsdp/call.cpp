// call.cpp — the hook point's entry points (fsdp/detail/call.h): fsdp::call finds the module's
// state, runs its pre-forward and post-forward, and turns LibTorch's error about freed storage
// into one that names the resharded FSDP modules.
#include <fsdp/call.h>

#include "src/fsdp/state.h"

#include <c10/util/Exception.h>

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

void rethrow_forward_error(FSDPState& state) {
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
