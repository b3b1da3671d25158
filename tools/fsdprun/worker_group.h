// The local workers of one attempt: spawning (fork + exec), forwarding their output,
// reaping them, and stopping them (SIGTERM, then SIGKILL after a grace period).
#pragma once

#include "output.h"
#include "spawn.h"

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <sys/types.h>
#include <vector>

namespace fsdprun {

struct WorkerSpec {
  int rank = 0;
  int local_rank = 0;
  std::vector<std::string> env;  // complete environment, "KEY=VALUE"
};

struct GroupSpec {
  std::vector<std::string> command;  // PROGRAM ARGS...; PROGRAM is looked up in PATH
  std::vector<WorkerSpec> workers;
  int attempt = 0;
  std::string log_dir;  // empty: no log files
  bool console = true;  // show worker output on the console
  bool prefix = true;   // prefix console lines with "[rankN]:"
};

// How a worker ended.
struct WorkerExit {
  bool signaled = false;
  int value = 0;  // exit code, or signal number when signaled
  bool ok() const { return !signaled && value == 0; }
  std::string describe() const;  // "exited with code 3" / "was killed by signal SIGKILL (9)"
};

struct WorkerFailure {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  WorkerExit how;
  std::string describe() const;  // "rank 1 (local_rank 1, pid 42) exited with code 3"
};

class WorkerGroup {
 public:
  explicit WorkerGroup(GroupSpec spec);
  // Kills (SIGKILL) and reaps any worker still running: a group never leaves orphans.
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts the workers one by one, asking keep_going before each: starting many takes
  // a while (a fork of fsdprun is not cheap), and a stop request must not wait for all.
  // Returns false when keep_going said no (the workers started so far keep running:
  // stop() them). Throws SpawnError (the destructor stops those already started).
  bool start(const std::function<bool()>& keep_going);
  // How many workers have been started.
  std::size_t started() const { return workers_.size(); }
  // Waits up to timeout_ms for worker output or for one of wake_fds to become readable,
  // and forwards the output that arrived. Does not read wake_fds; negative entries are
  // ignored.
  void pump(int timeout_ms, const std::vector<int>& wake_fds);
  // Reaps exited workers (their buffered output is forwarded first) and returns those
  // that failed, unless the group is being stopped (then exits are expected).
  std::vector<WorkerFailure> reap();
  bool running() const;
  bool stopping() const { return stopping_; }
  // Sends signo to every worker's process group; SIGKILL follows after grace_s.
  void stop(int signo, double grace_s);
  // Sends SIGKILL to every worker's process group now.
  void kill_now();
  // Sends the SIGKILL when the grace period is over. Returns milliseconds until the
  // deadline, or -1 when there is none pending.
  int enforce_deadline();
  // Forwards what is left in the pipes and flushes unterminated last lines.
  void finish_output();

  // For the flight-recorder diagnosis. The workers not reaped yet, as (rank, pid).
  std::vector<std::pair<int, pid_t>> unreaped() const;
  // How each reaped worker ended, by rank ("exited with code 1").
  std::vector<std::pair<int, std::string>> exits() const;

 private:
  struct Worker;
  void drain(Worker& w);
  void signal_all(int signo);

  GroupSpec spec_;
  std::vector<std::unique_ptr<Worker>> workers_;
  bool stopping_ = false;
  bool killed_ = false;
  std::chrono::steady_clock::time_point kill_deadline_;
};

}  // namespace fsdprun
