// error_of.h — the message a call throws, for the tests that check what an error names.
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace fsdp_test {

// The what() of the std::exception that f throws; empty when f returns without throwing.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace fsdp_test
