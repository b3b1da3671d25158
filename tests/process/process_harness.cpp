// process_harness.cpp — temporary directories, ports, processes and /proc lookups for the
// process tests (see process_harness.h).
#include "process_harness.h"

#include <arpa/inet.h>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <netinet/in.h>
#include <optional>
#include <poll.h>
#include <sstream>
#include <stdexcept>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace process_test {
namespace {

// The state letter and parent of a process, from /proc/<pid>/stat ('?' and -1 where the file
// could not be parsed); nullopt when there is no such process.
struct ProcStat {
  char state = '?';
  pid_t ppid = -1;
};

std::optional<ProcStat> proc_stat(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return std::nullopt;
  const std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  ProcStat s;
  const auto paren = content.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos || content.size() <= paren + 2) return s;
  std::istringstream rest(content.substr(paren + 2));
  rest >> s.state >> s.ppid;
  return s;
}

sockaddr_in loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

}  // namespace

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/fsdp_process_test_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = loopback(0);
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error("cannot find a free port");
  close(fd);
  return ntohs(addr.sin_port);
}

std::string describe(const RunResult& r) {
  return "exit " + std::to_string(r.exit_code) + (r.signaled ? " (signal)" : "") + (r.timed_out ? " TIMED OUT" : "") +
         "\n--- stdout:\n" + r.out + "\n--- stderr:\n" + r.err;
}

Process::Process(const std::string& program, const std::vector<std::string>& args, const Env& env,
                 const std::string& cwd) {
  std::vector<std::string> argv = {program};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const std::string out = capture_ / "out", err = capture_ / "err";
  started_ = now_seconds();
  pid_ = fork();
  if (pid_ == 0) {  // the test process is single-threaded: setenv is fine here
    for (const auto& [k, v] : env) v.empty() ? unsetenv(k.c_str()) : setenv(k.c_str(), v.c_str(), 1);
    if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(126);
    dup2(open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644), 1);
    dup2(open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644), 2);
    execv(cargv[0], cargv.data());
    _exit(127);
  }
}

Process::~Process() {
  if (!done_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

RunResult Process::wait(double timeout_s) {
  RunResult r;
  int status = 0;
  const double deadline = started_ + timeout_s;
  while (waitpid(pid_, &status, WNOHANG) == 0) {
    if (now_seconds() > deadline) {
      r.timed_out = true;
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  done_ = true;
  r.seconds = now_seconds() - started_;
  r.signaled = WIFSIGNALED(status);
  r.exit_code = r.signaled ? WTERMSIG(status) : WEXITSTATUS(status);
  r.out = read_file(capture_ / "out");
  r.err = read_file(capture_ / "err");
  return r;
}

std::string beside_this_program(const std::string& path) {
  if (path.empty() || path.front() == '/') return path;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  return (self.parent_path() / path).lexically_normal().string();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool wait_for_file(const std::string& path, double timeout_s) {
  const double deadline = now_seconds() + timeout_s;
  while (!std::filesystem::exists(path)) {
    if (now_seconds() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

std::map<std::string, std::string> read_env_file(const std::string& path) {
  std::map<std::string, std::string> env;
  std::istringstream in(read_file(path));
  for (std::string line; std::getline(in, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

bool process_gone(pid_t pid) {
  const std::optional<ProcStat> s = proc_stat(pid);
  return !s || s->state == 'Z';
}

std::vector<pid_t> wait_gone(const std::vector<pid_t>& pids, double timeout_s) {
  const double deadline = now_seconds() + timeout_s;
  for (;;) {
    std::vector<pid_t> alive;
    for (pid_t p : pids)
      if (!process_gone(p)) alive.push_back(p);
    if (alive.empty() || now_seconds() > deadline) return alive;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> kids;
  DIR* d = opendir("/proc");
  if (!d) return kids;
  while (dirent* e = readdir(d)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(e->d_name));  // 0 for entries that are no pid
    if (pid <= 0) continue;
    const std::optional<ProcStat> s = proc_stat(pid);
    if (s && s->ppid == parent) kids.push_back(pid);
  }
  closedir(d);
  return kids;
}

std::vector<std::string> listen_addresses(int port) {
  char port_hex[8];
  std::snprintf(port_hex, sizeof port_hex, "%04X", port);
  std::vector<std::string> found;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream in(read_file(table));
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == port_hex)
        found.push_back(local.substr(0, colon));
    }
  }
  return found;
}

bool can_connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  const sockaddr_in addr = loopback(port);
  const bool ok = connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
  close(fd);
  return ok;
}

HeldConnection::HeldConnection(int port, const std::string& bytes) {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const sockaddr_in addr = loopback(port);
  ok_ = fd_ >= 0 && connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0 &&
        send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

HeldConnection::~HeldConnection() {
  if (fd_ >= 0) close(fd_);
}

bool HeldConnection::wait_closed_by_server(double timeout_s) {
  pollfd p{fd_, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout_s * 1000)) != 1) return false;
  char byte;
  return recv(fd_, &byte, 1, MSG_DONTWAIT) <= 0;  // EOF (or a reset) once the server closed it
}

PortHolder::PortHolder(int port) {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = loopback(port);
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  if (fd_ >= 0 && (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd_, 1) != 0)) {
    close(fd_);
    fd_ = -1;
  }
}

PortHolder::~PortHolder() {
  if (fd_ >= 0) close(fd_);
}

}  // namespace process_test
