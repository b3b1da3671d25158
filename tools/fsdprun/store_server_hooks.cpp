// Why this file exists: LibTorch's TCPStore server creates and binds its sockets itself
// and offers no option for what fsdprun needs from them. So the fsdprun executable
// defines bind(); it is exported (ENABLE_EXPORTS, i.e. -rdynamic), so the dynamic linker
// resolves libtorch's calls to this definition rather than libc's, which it calls in
// turn (dlsym RTLD_NEXT). Every bind() outside a StoreServerBind passes through unchanged.
// While one lives, the only socket bound is the store's listener: the store's own client
// in the same constructor connects without binding.
//
// Loopback: with --standalone the store must be reachable from this machine only, but
// LibTorch's store server listens on the wildcard address (its listen op resolves
// getaddrinfo(nullptr, port, AI_PASSIVE), giving 0.0.0.0 or the dual-stack ::). While a
// StoreServerBind(loopback_only) lives, a wildcard address is rewritten to loopback. It
// also remembers an EADDRINUSE, so that fsdprun can say "port in use" in its own words
// instead of parsing LibTorch's message.
//
// Stalled clients: LibTorch's older store server (TCPStoreMasterDaemon: 1.13's, and 2.x's
// non-libuv backend) is one thread that polls all client sockets and, once one is readable,
// reads the whole request with blocking recv() calls. A client that sends the first
// bytes of a request and then nothing stops that thread, and so the store, for every
// other client, for as long as it likes. So the store's listener gets SO_RCVTIMEO and
// SO_SNDTIMEO before it is bound; on Linux a socket returned by accept() inherits both
// from its listener, so every client connection has them without fsdprun touching
// accept(). A recv() (or send()) that makes no progress for kStalledRequestTimeoutMs then
// fails with EAGAIN, which LibTorch turns into an exception; the server catches
// exceptions of a request, closes that client's socket, forgets its waits and goes on
// serving the others. On the listener itself the receive timeout would bound a blocking
// accept(), but the daemon calls accept() only after poll() reported the listener
// readable, i.e. with a connection already queued, so accepting never waits for it.
// Legitimate clients are not affected: the server reads only after poll() said the
// socket is readable, and a client sends a request in one go, so a recv() waits at most
// for the rest of a request already on its way; waits (WAIT, and the waits inside GET)
// are kept on the server without a blocking read; a reply blocks send() only while the
// client's receive buffer is full. The timeout is per call, so a large value that keeps
// flowing is never cut off. The libuv backend of 2.x reads without blocking and has no
// such stall; there the options have no effect.

#include "store_server_hooks.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>

namespace fsdprun {
namespace {

std::atomic<int> g_loopback_only{0};
std::atomic<int> g_binding{0};              // StoreServerBind instances alive
std::atomic<bool> g_address_in_use{false};  // a bind failed with EADDRINUSE meanwhile

bool binding() { return g_binding.load() > 0; }
bool loopback_only() { return g_loopback_only.load() > 0; }

// Called by bind() below; errno is kept, as the callers of bind() look at it.
void after_bind(int result) {
  if (result != 0 && errno == EADDRINUSE && binding()) g_address_in_use = true;
}

// Before the real bind(), so that the listener has the options before any connection
// can be queued on it. Best effort: a socket that refuses them only loses the protection
// against stalled clients. errno is kept, for the same reason as in after_bind().
void limit_stalls(int fd) {
  const int saved = errno;
  timeval tv{};
  tv.tv_sec = kStalledRequestTimeoutMs / 1000;
  tv.tv_usec = (kStalledRequestTimeoutMs % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  errno = saved;
}

}  // namespace

StoreServerBind::StoreServerBind(bool loopback_only) : loopback_only_(loopback_only) {
  g_address_in_use = false;
  ++g_binding;
  if (loopback_only_) ++g_loopback_only;
}

StoreServerBind::~StoreServerBind() {
  --g_binding;
  if (loopback_only_) --g_loopback_only;
}

bool StoreServerBind::address_in_use() const { return g_address_in_use; }

}  // namespace fsdprun

namespace {

template <typename Fn>
Fn next_definition(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

bool is_v6_only(int fd) {
  int v6only = 0;
  socklen_t len = sizeof v6only;
  return getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &len) == 0 && v6only != 0;
}

// The loopback counterpart of a wildcard address; other addresses are returned as they are.
sockaddr_storage loopback_for(const sockaddr* addr, socklen_t len, int fd) {
  sockaddr_storage out{};
  std::memcpy(&out, addr, len);  // bind() passes larger addresses through unchanged
  if (addr->sa_family == AF_INET && len >= sizeof(sockaddr_in)) {
    auto& in4 = reinterpret_cast<sockaddr_in&>(out);
    if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else if (addr->sa_family == AF_INET6 && len >= sizeof(sockaddr_in6)) {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(out);
    if (IN6_IS_ADDR_UNSPECIFIED(&in6.sin6_addr)) {
      // A dual-stack socket bound to the IPv4-mapped ::ffff:127.0.0.1 accepts the IPv4
      // clients that connect to MASTER_ADDR=127.0.0.1. An IPv6-only socket cannot take
      // a mapped address, so it gets ::1.
      static const unsigned char kMappedLoopback[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
      if (is_v6_only(fd)) {
        in6.sin6_addr = in6addr_loopback;
      } else {
        std::memcpy(&in6.sin6_addr, kMappedLoopback, sizeof kMappedLoopback);
      }
    }
  }
  return out;
}

}  // namespace

extern "C" int bind(int fd, const struct sockaddr* addr, socklen_t len) noexcept {
  using BindFn = int (*)(int, const struct sockaddr*, socklen_t);
  static const BindFn real = next_definition<BindFn>("bind");
  if (real == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  if (fsdprun::binding()) fsdprun::limit_stalls(fd);
  int result;
  if (!fsdprun::loopback_only() || addr == nullptr || len > sizeof(sockaddr_storage)) {
    result = real(fd, addr, len);
  } else {
    const sockaddr_storage local = loopback_for(addr, len, fd);
    result = real(fd, reinterpret_cast<const sockaddr*>(&local), len);
  }
  fsdprun::after_bind(result);
  return result;
}
