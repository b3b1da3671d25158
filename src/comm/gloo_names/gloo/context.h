// Stands in for gloo's header of that name, for c10d's ProcessGroupGloo.hpp only (README.md):
// ProcessGroupGloo::setTimeout, inline in that header, sets each context's timeout.
#pragma once

#include <chrono>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
