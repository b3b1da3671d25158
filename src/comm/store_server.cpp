#include "src/comm/store_server.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <cerrno>
#include <cstring>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace fsdp {
namespace comm {
namespace {

using AddrInfoPtr = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

// The candidate addresses to bind; for the wildcard, IPv6 first (one dual-stack socket serves
// both families), IPv4 where the machine has no IPv6.
std::vector<const addrinfo*> bind_candidates(const addrinfo* found, bool wildcard) {
  std::vector<const addrinfo*> out;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) out.push_back(a);
  if (wildcard) {
    std::stable_partition(out.begin(), out.end(), [](const addrinfo* a) { return a->ai_family == AF_INET6; });
  }
  return out;
}

int try_listen(const addrinfo& a, bool wildcard, int& error) {
  const int fd = socket(a.ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = errno;
    return -1;
  }
  const int on = 1, off = 0;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);  // a restarted job rebinds at once
  if (wildcard && a.ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
  if (::bind(fd, a.ai_addr, a.ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) return fd;
  error = errno;
  close(fd);
  return -1;
}

std::string where(const std::string& address, int port) {
  return (address.empty() ? std::string("every address") : address) + " port " + std::to_string(port);
}

int bound_listener(const std::string& address, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* raw = nullptr;
  const int rc = getaddrinfo(address.empty() ? nullptr : address.c_str(), std::to_string(port).c_str(), &hints, &raw);
  if (rc != 0) {
    throw StoreBindError("cannot resolve the store's address '" + address + "': " + gai_strerror(rc), false);
  }
  AddrInfoPtr found(raw, &freeaddrinfo);
  int error = 0;
  for (const addrinfo* a : bind_candidates(found.get(), address.empty())) {
    const int fd = try_listen(*a, address.empty(), error);
    if (fd >= 0) return fd;
    if (error == EADDRINUSE) break;
  }
  throw StoreBindError("cannot listen on " + where(address, port) + ": " + std::strerror(error), error == EADDRINUSE);
}

int port_of(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

}  // namespace

c10::intrusive_ptr<c10d::TCPStore> host_store(const StoreServerOptions& options) {
  const int fd = bound_listener(options.bind_address, options.port);
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(port_of(fd));
  o.isServer = true;
  o.numWorkers = c10::nullopt;
  o.waitWorkers = false;
  o.timeout = options.timeout;
  o.masterListenFd = fd;  // the server owns it from here on
  o.useLibUV = true;
  const std::string client_host = options.bind_address.empty() ? "127.0.0.1" : options.bind_address;
  return c10::make_intrusive<c10d::TCPStore>(client_host, o);
}

std::string address_of_interface(const std::string& name) {
  ifaddrs* raw = nullptr;
  if (getifaddrs(&raw) != 0) throw std::runtime_error(std::string("getifaddrs: ") + std::strerror(errno));
  std::unique_ptr<ifaddrs, decltype(&freeifaddrs)> all(raw, &freeifaddrs);
  std::string v4, v6;
  for (const ifaddrs* i = all.get(); i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || name != i->ifa_name) continue;
    char text[INET6_ADDRSTRLEN] = {0};
    if (i->ifa_addr->sa_family == AF_INET && v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text);
      v4 = text;
    } else if (i->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr, text, sizeof text);
      v6 = text;
    }
  }
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  throw std::runtime_error("network interface '" + name + "' does not exist or has no IP address (ip addr lists them)");
}

bool is_loopback_address(const std::string& address) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* raw = nullptr;
  if (getaddrinfo(address.c_str(), nullptr, &hints, &raw) != 0) return false;
  AddrInfoPtr found(raw, &freeaddrinfo);
  for (const addrinfo* a = found.get(); a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const uint32_t ip = ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr);
      if ((ip >> 24) != 127) return false;
    } else if (a->ai_family == AF_INET6) {
      if (!IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr)) return false;
    }
  }
  return found != nullptr;
}

}  // namespace comm
}  // namespace fsdp
