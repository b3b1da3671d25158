// Helpers for the fsdprun tests: temporary directories, free ports, running fsdprun
// as a real process with its output captured, and looking at processes and sockets.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <sys/types.h>
#include <vector>

namespace launcher_test {

// Paths of the programs under test (compile definitions set by CMake).
std::string fsdprun_path();
std::string worker_path();

// A fresh directory, removed with its contents at the end of the scope.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A TCP port that was free on loopback a moment ago.
int free_port();

struct RunResult {
  bool timed_out = false;
  bool signaled = false;
  int exit_code = -1;  // or the signal number when signaled
  double seconds = 0;
  std::string out;
  std::string err;
};

// A program started in the background, stdout/stderr captured in files.
class Process {
 public:
  // env: variables to set ("" as the value unsets the variable); cwd: "" = the test's.
  Process(const std::string& program, const std::vector<std::string>& args,
          const std::map<std::string, std::string>& env = {}, const std::string& cwd = "");
  virtual ~Process();  // kills it if still running
  pid_t pid() const { return pid_; }
  // Waits at most timeout_s; on timeout kills it (SIGKILL) and says so.
  RunResult wait(double timeout_s = 30);

 private:
  TempDir capture_;
  pid_t pid_ = -1;
  bool done_ = false;
  double started_ = 0;
};

// fsdprun started in the background.
class Fsdprun : public Process {
 public:
  Fsdprun(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {},
          const std::string& cwd = "")
      : Process(fsdprun_path(), args, env, cwd) {}
};

RunResult run_fsdprun(const std::vector<std::string>& args,
                      const std::map<std::string, std::string>& env = {}, double timeout_s = 30);

std::string read_file(const std::string& path);
// Waits until the file exists (at most timeout_s); returns whether it does.
bool wait_for_file(const std::string& path, double timeout_s = 10);
// KEY=VALUE lines.
std::map<std::string, std::string> read_env_file(const std::string& path);
// Values of the pid_* files the test worker wrote in dir.
std::vector<pid_t> worker_pids(const std::string& dir);
// A process that exited but was not reaped yet (zombie) counts as gone.
bool process_gone(pid_t pid);
// Waits (at most timeout_s) until all are gone; returns those still alive.
std::vector<pid_t> wait_gone(const std::vector<pid_t>& pids, double timeout_s = 5);

// Local addresses (hex, as in /proc/net/tcp{,6}) of the sockets listening on port.
std::vector<std::string> listen_addresses(int port);
// True when a TCP connection to 127.0.0.1:port succeeds.
bool can_connect(int port);

double now_seconds();

}  // namespace launcher_test
