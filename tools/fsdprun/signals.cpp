#include "signals.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <string>
#include <unistd.h>

namespace fsdprun {
namespace {

int g_pipe[2] = {-1, -1};

// Async-signal-safe: only write() and errno are touched. If the pipe is full the
// byte is dropped, which is harmless: the reader is already due to wake up, and
// SIGCHLD is handled by reaping every worker, not by counting signals.
void on_signal(int signo) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(signo);
  ssize_t ignored = write(g_pipe[1], &byte, 1);
  (void)ignored;
  errno = saved;
}

void set_handler(int signo) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | (signo == SIGCHLD ? SA_NOCLDSTOP : 0);
  if (sigaction(signo, &sa, nullptr) != 0) throw std::runtime_error(std::string("sigaction: ") + std::strerror(errno));
}

}  // namespace

void SignalPipe::install() {
  if (pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  // SIGUSR1 asks the workers for flight-recorder dumps (fsdprun --dump).
  for (int signo : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGUSR1}) set_handler(signo);
  // Writes to a console or log reader that went away must fail with EPIPE, not kill us.
  // (Workers get SIGPIPE back to its default before exec.)
  signal(SIGPIPE, SIG_IGN);
}

int SignalPipe::fd() { return g_pipe[0]; }

std::vector<int> SignalPipe::take() {
  std::vector<int> signals;
  unsigned char buf[64];
  for (;;) {
    const ssize_t n = read(g_pipe[0], buf, sizeof buf);
    if (n > 0) {
      signals.insert(signals.end(), buf, buf + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return signals;  // EAGAIN: drained
  }
}

bool is_stop_signal(int signo) { return signo == SIGINT || signo == SIGTERM || signo == SIGHUP; }

std::string signal_name(int signo) {
  const char* abbrev = sigabbrev_np(signo);  // "KILL" for 9 (glibc >= 2.32)
  return abbrev != nullptr ? std::string("SIG") + abbrev : "SIG?";
}

}  // namespace fsdprun
