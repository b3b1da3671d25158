// Why this file exists: with --standalone the agent store must be reachable from this
// machine only. LibTorch 1.13's TCPStore server always listens on the wildcard
// address (its listen op resolves getaddrinfo(nullptr, port, AI_PASSIVE), giving
// 0.0.0.0 or the dual-stack ::) and takes neither a host to bind nor a pre-bound
// socket. So the fsdprun executable defines bind() itself; it is exported
// (ENABLE_EXPORTS, i.e. -rdynamic), so the dynamic linker resolves libtorch's call to
// bind() to this definition rather than libc's. While a LoopbackOnlyBind is alive,
// a wildcard address is rewritten to loopback; then libc's bind (dlsym RTLD_NEXT)
// does the work. Everything else passes through unchanged.

#include "loopback_bind.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>

namespace fsdprun {
namespace {
std::atomic<int> g_loopback_only{0};
}  // namespace

LoopbackOnlyBind::LoopbackOnlyBind() { ++g_loopback_only; }
LoopbackOnlyBind::~LoopbackOnlyBind() { --g_loopback_only; }

}  // namespace fsdprun

namespace {

using BindFn = int (*)(int, const struct sockaddr*, socklen_t);

BindFn real_bind() {
  static const BindFn fn = reinterpret_cast<BindFn>(dlsym(RTLD_NEXT, "bind"));
  return fn;
}

bool is_v6_only(int fd) {
  int v6only = 0;
  socklen_t len = sizeof v6only;
  return getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &len) == 0 && v6only != 0;
}

}  // namespace

extern "C" int bind(int fd, const struct sockaddr* addr, socklen_t len) noexcept {
  const BindFn real = real_bind();
  if (real == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  if (fsdprun::g_loopback_only.load() == 0 || addr == nullptr) return real(fd, addr, len);

  if (addr->sa_family == AF_INET && len >= sizeof(sockaddr_in)) {
    sockaddr_in in4;
    std::memcpy(&in4, addr, sizeof in4);
    if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return real(fd, reinterpret_cast<const sockaddr*>(&in4), sizeof in4);
  }
  if (addr->sa_family == AF_INET6 && len >= sizeof(sockaddr_in6)) {
    sockaddr_in6 in6;
    std::memcpy(&in6, addr, sizeof in6);
    if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
      // A dual-stack socket bound to the IPv4-mapped ::ffff:127.0.0.1 accepts the IPv4
      // clients that connect to MASTER_ADDR=127.0.0.1. An IPv6-only socket cannot take
      // a mapped address, so it gets ::1.
      if (is_v6_only(fd)) {
        in6.sin6_addr = in6addr_loopback;
      } else {
        static const unsigned char kMappedLoopback[16] = {0, 0, 0, 0, 0, 0, 0, 0,
                                                          0, 0, 0xff, 0xff, 127, 0, 0, 1};
        std::memcpy(&in6.sin6_addr, kMappedLoopback, sizeof kMappedLoopback);
      }
    }
    return real(fd, reinterpret_cast<const sockaddr*>(&in6), sizeof in6);
  }
  return real(fd, addr, len);
}
