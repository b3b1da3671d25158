// Stands in for gloo's header of that name, for c10d's ProcessGroupGloo.hpp only (README.md):
// the header holds both through smart pointers.
#pragma once

namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo
