// What fsdprun changes about the sockets of the agent store's server, which LibTorch
// creates and owns: fsdprun's executable defines (and exports) bind(), accept() and
// accept4(), so that LibTorch's calls reach these hooks first (store_server_hooks.cpp).
#pragma once

namespace fsdprun {

// A store request, or reply, that makes no progress for this long drops its client.
constexpr int kStalledRequestTimeoutMs = 5000;

// Lives around the creation of the store's server. Meanwhile, bind() calls of this
// process that ask for the wildcard address get loopback instead when loopback_only,
// and a bind() that fails with EADDRINUSE is remembered.
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

// From now on, every connection accepted on local port `port` (the store's) gives up a
// receive or send that makes no progress for kStalledRequestTimeoutMs. Call it before
// the store's server starts; one port at a time (the last call wins).
void limit_stalls_on_port(int port);

}  // namespace fsdprun
