// store_server.h — hosting a c10d::TCPStore server on a listening socket bound where the job's
// ranks are. Used by every store the project hosts: fsdprun's agent store, the rendezvous
// store of rank 0 and, under MPI, the progress board's.
//
// c10d's server would bind the wildcard address of its port itself. The socket is created here
// instead and handed over (TCPStoreOptions::masterListenFd), so that a store can listen on
// loopback only (a job on one machine) or on one address (the interface a user named), and a
// port already taken is reported as such.
//
// The server is always c10d's libuv one (TCPStoreOptions::useLibUV): it reads without blocking,
// so a client that sends part of a request and stops delays no other client, no waiting rank
// and no shutdown; it holds only its own connection, which closes with the store. It also
// closes at once, without reading further, a client whose request claims a key over 8 KiB, a
// value over 8 MiB or more than 128 Ki keys: no claim makes the server reserve memory.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <stdexcept>
#include <string>

namespace c10d {
class TCPStore;
}

namespace fsdp {
namespace comm {

// Binding the store's address failed; address_in_use() says whether the port was taken.
class StoreBindError : public std::runtime_error {
 public:
  StoreBindError(const std::string& what, bool address_in_use)
      : std::runtime_error(what), address_in_use_(address_in_use) {}
  bool address_in_use() const { return address_in_use_; }

 private:
  bool address_in_use_;
};

struct StoreServerOptions {
  // A numeric IPv4 or IPv6 address or a host name that resolves to one of this machine's;
  // empty: every address (IPv6 and IPv4).
  std::string bind_address;
  int port = 0;  // 0: any free port (TCPStore::getPort() says which)
  // Of the server's own client connection, and of the waits made through it.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

// A store server on a socket bound as `options` say, with the client connection c10d's
// TCPStore keeps beside it. Blocks for the bind and the client's connect only. Throws
// StoreBindError when the address cannot be bound, c10::Error for the rest.
c10::intrusive_ptr<c10d::TCPStore> host_store(const StoreServerOptions& options);

// The IPv4 address of network interface `name` (e.g. "eth0"), else its IPv6 one. Throws
// std::runtime_error naming the interface when it does not exist or has no address.
std::string address_of_interface(const std::string& name);

// True when `address` (numeric, or a name resolving to it) is a loopback address.
bool is_loopback_address(const std::string& address);

}  // namespace comm
}  // namespace fsdp
