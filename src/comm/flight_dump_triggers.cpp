// The flight recorder's dump triggers (flight_dump_triggers.h): signal handlers and the
// watchdog thread that writes the dumps they ask for.
#include "src/comm/flight_dump_triggers.h"

#include <fsdp/flight_recorder.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <poll.h>
#include <pthread.h>
#include <string>
#include <thread>
#include <unistd.h>

namespace fsdp {
namespace comm {
namespace {

constexpr int kSignals[] = {SIGUSR1, SIGTERM, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
constexpr int kMaxSignal = 65;
// How long a signal that ends the process waits for its dump. A dump of a few thousand records
// takes milliseconds; the bound is for a watchdog that cannot take the recorder's lock.
constexpr int kFatalDumpWaitMs = 3000;

int g_pipe[2] = {-1, -1};
std::atomic<int64_t> g_dumps_done{0};
std::atomic<int64_t> g_dumps_asked{0};
struct sigaction g_previous[kMaxSignal];

const char* signal_name(int signo) {
  switch (signo) {
    case SIGUSR1: return "SIGUSR1";
    case SIGTERM: return "SIGTERM";
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
  }
  return "signal";
}

bool is_function(const struct sigaction& sa) {
  if (sa.sa_flags & SA_SIGINFO) return sa.sa_sigaction != nullptr;
  return sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN;
}

void call_previous(int signo, siginfo_t* info, void* ucontext) {
  const struct sigaction& prev = g_previous[signo];
  if (prev.sa_flags & SA_SIGINFO) {
    prev.sa_sigaction(signo, info, ucontext);
  } else {
    prev.sa_handler(signo);
  }
}

// Async-signal-safe: write(), poll() as a sleep, sigaction(), raise() and lock-free atomics.
extern "C" void on_dump_signal(int signo, siginfo_t* info, void* ucontext) {
  const int saved = errno;
  const int64_t asked = g_dumps_asked.fetch_add(1) + 1;
  const unsigned char byte = static_cast<unsigned char>(signo);
  ssize_t ignored = write(g_pipe[1], &byte, 1);
  (void)ignored;
  if (signo == SIGUSR1) {
    errno = saved;
    return;  // on demand: the process goes on
  }
  if (signo == SIGTERM && is_function(g_previous[signo])) {
    call_previous(signo, info, ucontext);  // e.g. fsdp-train's checkpoint-and-stop; the dump follows meanwhile
    errno = saved;
    return;
  }
  for (int waited = 0; g_dumps_done.load() < asked && waited < kFatalDumpWaitMs; waited += 10) poll(nullptr, 0, 10);
  if (is_function(g_previous[signo])) {
    call_previous(signo, info, ucontext);
  } else {
    // The previous disposition again; the signal is blocked while this handler runs, so the
    // raised one is delivered when it returns (a fault returns to the faulting instruction).
    sigaction(signo, &g_previous[signo], nullptr);
    if (signo != SIGSEGV && signo != SIGBUS && signo != SIGFPE && signo != SIGILL) raise(signo);
  }
  errno = saved;
}

void watchdog_loop() {
  for (;;) {
    unsigned char byte = 0;
    const ssize_t n = read(g_pipe[0], &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1) return;
    FlightRecorder::global().dump(std::string("signal ") + signal_name(byte));
    g_dumps_done.fetch_add(1);
  }
}

}  // namespace

void install_flight_dump_triggers() {
  static std::once_flag once;
  std::call_once(once, [] {
    TORCH_CHECK(pipe2(g_pipe, O_CLOEXEC) == 0, "fsdp flight recorder: pipe2 failed: ", std::strerror(errno));
    // A full pipe must not block a handler: the watchdog is due to wake anyway.
    fcntl(g_pipe[1], F_SETFL, fcntl(g_pipe[1], F_GETFL) | O_NONBLOCK);
    // The watchdog never runs a handler itself (it must be free to write the dump), so it is
    // started with every signal blocked; the mask is inherited by the new thread only.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    std::thread(watchdog_loop).detach();
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    for (int signo : kSignals) {
      struct sigaction sa {};
      sa.sa_sigaction = on_dump_signal;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_SIGINFO | SA_RESTART;
      sigaction(signo, &sa, &g_previous[signo]);
    }
  });
}

}  // namespace comm
}  // namespace fsdp
