// process_harness.h — helpers for tests that run programs as real processes (the fsdprun and
// fsdp-train tests): temporary directories, free ports, starting a program with its output
// captured, and looking at processes and sockets through /proc.
//
// Nothing here knows which programs are tested: each test binary names its own (Program).
#pragma once

#include <map>
#include <string>
#include <sys/types.h>
#include <utility>
#include <vector>

namespace process_test {

// Environment changes for a started program: "" as the value unsets the variable.
using Env = std::map<std::string, std::string>;

// A fresh directory, removed with its contents at the end of the scope.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
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

// Exit status and captured output, for a failing assertion's message.
std::string describe(const RunResult& r);

// A program started in the background, stdout/stderr captured in files.
class Process {
 public:
  // cwd: "" = the test's.
  Process(const std::string& program, const std::vector<std::string>& args, const Env& env = {},
          const std::string& cwd = "");
  ~Process();  // kills it if still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  pid_t pid() const { return pid_; }
  // Waits at most timeout_s (counted from the start); on timeout kills it (SIGKILL) and says so.
  RunResult wait(double timeout_s = 30);

 private:
  TempDir capture_;
  pid_t pid_ = -1;
  bool done_ = false;
  double started_ = 0;
};

// `path` relative to the folder of the running test program (absolute paths are returned as they
// are). Test binaries get the programs they run as such relative paths: compile definitions that
// named the build folder would differ between the CPU and CUDA configurations' folders, and the
// object file could not be shared between them.
std::string beside_this_program(const std::string& path);

// A program under test, by its path.
class Program {
 public:
  explicit Program(std::string path) : path_(std::move(path)) {}
  const std::string& path() const { return path_; }
  // Started in the background.
  Process start(const std::vector<std::string>& args, const Env& env = {}, const std::string& cwd = "") const {
    return Process(path_, args, env, cwd);
  }
  // Started and waited for (at most timeout_s).
  RunResult run(const std::vector<std::string>& args, const Env& env = {}, double timeout_s = 30,
                const std::string& cwd = "") const {
    return start(args, env, cwd).wait(timeout_s);
  }

 private:
  std::string path_;
};

std::string read_file(const std::string& path);
// Waits until the file exists (at most timeout_s); returns whether it does.
bool wait_for_file(const std::string& path, double timeout_s = 10);
// KEY=VALUE lines.
std::map<std::string, std::string> read_env_file(const std::string& path);

// A process that exited but was not reaped yet (zombie) counts as gone.
bool process_gone(pid_t pid);
// Waits (at most timeout_s) until all are gone; returns those still alive.
std::vector<pid_t> wait_gone(const std::vector<pid_t>& pids, double timeout_s = 5);
// The direct children of `parent`.
std::vector<pid_t> children_of(pid_t parent);

// Local addresses (hex, as in /proc/net/tcp{,6}) of the sockets listening on port.
std::vector<std::string> listen_addresses(int port);
// True when a TCP connection to 127.0.0.1:port succeeds.
bool can_connect(int port);

// A client of 127.0.0.1:port that sends `bytes` and then holds the connection without
// sending more, as a stuck or hostile client would. Closed when destroyed.
class HeldConnection {
 public:
  HeldConnection(int port, const std::string& bytes);
  ~HeldConnection();
  HeldConnection(const HeldConnection&) = delete;
  HeldConnection& operator=(const HeldConnection&) = delete;
  // Whether the connection was made and the bytes were sent.
  bool ok() const { return ok_; }
  // Waits (at most timeout_s) until the server closes the connection; returns whether it did.
  bool wait_closed_by_server(double timeout_s);

 private:
  int fd_ = -1;
  bool ok_ = false;
};

// A TCP socket listening on the wildcard address of port (as another program holding the
// port would), until destroyed.
class PortHolder {
 public:
  explicit PortHolder(int port);
  ~PortHolder();
  PortHolder(const PortHolder&) = delete;
  PortHolder& operator=(const PortHolder&) = delete;
  bool ok() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

double now_seconds();

}  // namespace process_test
