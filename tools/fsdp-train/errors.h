// errors.h — the one-line text of an error the trainer prints. LibTorch's c10::Error::what()
// carries a C++ backtrace of a dozen frames; a user needs the message, once per rank.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace fsdp {
namespace train {

inline std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace train
}  // namespace fsdp
