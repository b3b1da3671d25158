// model_shape.cpp — the sizes of model_shape.h.
#include "models/model_shape.h"

#include <stdexcept>

namespace fsdp {
namespace train {

int64_t size_named(const std::vector<PlanSize>& sizes, const std::string& name) {
  for (const PlanSize& s : sizes)
    if (s.name == name) return s.value;
  throw std::logic_error("model family: no size named '" + name + "'");
}

std::vector<PlanSize> with_size(std::vector<PlanSize> sizes, const std::string& name, int64_t value) {
  for (PlanSize& s : sizes)
    if (s.name == name) {
      s.value = value;
      return sizes;
    }
  throw std::logic_error("model family: no size named '" + name + "'");
}

}  // namespace train
}  // namespace fsdp
