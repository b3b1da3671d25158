// Stands in for gloo's header of that name, for c10d's ProcessGroupGloo.hpp only (README.md):
// its inline GlooStore adapter overrides these four functions. fsdp-cpp never constructs a
// GlooStore (libtorch_cpu's ProcessGroupGloo constructor does, against gloo's real class).
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace gloo {
namespace rendezvous {
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) = 0;
};
}  // namespace rendezvous
}  // namespace gloo
