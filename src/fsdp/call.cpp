// call.cpp — FSDP's side of the hook point: an error that escaped a forward called through
// fsdp::call marks the iteration failed, and LibTorch's error about freed storage becomes one
// that names the resharded FSDP modules.
#include "src/fsdp/state.h"

#include <c10/util/Exception.h>

#include <string>

namespace fsdp {
namespace detail {

void FSDPState::rethrow_forward_error() {
  mark_iteration_failed();
  try {
    throw;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    const bool freed_storage = msg.find("data is not allocated yet") != std::string::npos ||
                               msg.find("storage of size 0") != std::string::npos;
    const auto resharded = resharded_modules_below();
    if (!freed_storage || resharded.empty()) throw;
    std::string names;
    for (const auto& n : resharded) names += (names.empty() ? "'" : ", '") + n + "'";
    TORCH_CHECK(false,
                "fsdp: a module computed on resharded (freed) parameters. At that moment these FSDP modules "
                "were resharded: ",
                names,
                ". Call FSDP modules through fsdp::call(module, ...) instead of "
                "module->forward(...) or module(...), or unshard() them first. LibTorch said: ",
                msg);
  }
}

}  // namespace detail
}  // namespace fsdp
