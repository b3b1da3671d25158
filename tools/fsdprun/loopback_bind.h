// Keeping a listening socket on loopback when the code that binds it cannot be told so.
#pragma once

namespace fsdprun {

// While an instance exists, bind() calls of this process that ask for the wildcard
// address are redirected to loopback (see loopback_bind.cpp for why and how).
class LoopbackOnlyBind {
 public:
  LoopbackOnlyBind();
  ~LoopbackOnlyBind();
  LoopbackOnlyBind(const LoopbackOnlyBind&) = delete;
  LoopbackOnlyBind& operator=(const LoopbackOnlyBind&) = delete;
};

}  // namespace fsdprun
