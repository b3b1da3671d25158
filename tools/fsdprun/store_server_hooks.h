// What fsdprun changes about the sockets of the agent store's server, which LibTorch
// creates and owns: fsdprun's executable defines (and exports) bind(), so that
// LibTorch's calls reach this hook first (store_server_hooks.cpp).
#pragma once

namespace fsdprun {

// A store request, or reply, that makes no progress for this long drops its client.
constexpr int kStalledRequestTimeoutMs = 5000;

// Lives around the creation of the store's server. Meanwhile, every socket that this
// process binds gives up a receive or send that makes no progress for
// kStalledRequestTimeoutMs (and so do the connections accepted on it); bind() calls
// that ask for the wildcard address get loopback instead when loopback_only; and a
// bind() that fails with EADDRINUSE is remembered.
class StoreServerBind {
 public:
  explicit StoreServerBind(bool loopback_only);
  ~StoreServerBind();
  StoreServerBind(const StoreServerBind&) = delete;
  StoreServerBind& operator=(const StoreServerBind&) = delete;

  // True when a bind() failed with EADDRINUSE while this instance lived.
  bool address_in_use() const;

 private:
  bool loopback_only_;
};

}  // namespace fsdprun
