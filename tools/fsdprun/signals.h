// Signal handling through a self-pipe, so that one poll() loop sees worker output,
// child exits (SIGCHLD), stop requests (SIGINT/SIGTERM/SIGHUP) and dump requests (SIGUSR1)
// together.
#pragma once

#include <string>
#include <vector>

namespace fsdprun {

class SignalPipe {
 public:
  // Installs the handlers; call once, before any worker is started.
  static void install();
  // Read end of the self-pipe: readable when a signal arrived.
  static int fd();
  // Drains the pipe and returns the signals received since the last call, in order.
  static std::vector<int> take();
};

// True for the signals that ask fsdprun to stop (and are forwarded to workers).
bool is_stop_signal(int signo);

// "SIGKILL" for 9, "SIG?" for an unknown number.
std::string signal_name(int signo);

}  // namespace fsdprun
