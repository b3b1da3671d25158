// stop_signal.cpp — the stop request of SIGTERM/SIGINT (see stop_signal.h).
#include "run/stop_signal.h"

#include <atomic>
#include <csignal>

namespace fsdp {
namespace train {
namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
  std::signal(sig, SIG_DFL);  // a second one stops the process at once
}

}  // namespace

void install_stop_signal_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
}

int stop_signal() { return g_stop_signal.load(); }

}  // namespace train
}  // namespace fsdp
