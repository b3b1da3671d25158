#include "spawn.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

namespace fsdprun {
namespace {

// Everything the child needs, prepared before fork(): between fork and exec the child
// of a multi-threaded process (the TCPStore runs threads) may only make
// async-signal-safe calls, so no allocation happens there.
struct ExecPlan {
  std::vector<char*> argv;
  std::vector<char*> envp;
  int devnull = -1;
  int out_fd = -1;
  int err_fd = -1;
  int status_fd = -1;  // write end of a CLOEXEC pipe: gets errno if exec fails
  pid_t parent = 0;
  int max_fd = 0;
};

std::vector<char*> c_strings(const std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (const auto& s : strings) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Descriptors fsdprun did not open itself (e.g. libtorch's store sockets, if not
// CLOEXEC) must not leak into workers: mark everything above stderr close-on-exec.
void mark_fds_cloexec(int max_fd) {
  if (syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) == 0) return;
  for (int fd = 3; fd < max_fd; ++fd) {
    const int flags = fcntl(fd, F_GETFD);
    if (flags >= 0) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
  }
}

[[noreturn]] void exec_child(const ExecPlan& plan) {
  setpgid(0, 0);
  // If fsdprun dies (even by SIGKILL), the kernel kills the worker: no orphans.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != plan.parent) _exit(127);  // fsdprun died before prctl took effect
  for (int signo : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) signal(signo, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  if (dup2(plan.devnull, 0) < 0 || dup2(plan.out_fd, 1) < 0 || dup2(plan.err_fd, 2) < 0) {
    const int err = errno;
    ssize_t ignored = write(plan.status_fd, &err, sizeof err);
    (void)ignored;
    _exit(127);
  }
  mark_fds_cloexec(plan.max_fd);
  execvpe(plan.argv[0], plan.argv.data(), plan.envp.data());
  const int err = errno;
  ssize_t ignored = write(plan.status_fd, &err, sizeof err);
  (void)ignored;
  _exit(127);
}

// Blocks until the child exec'd (EOF on the status pipe) or reported an errno.
int read_exec_status(int fd) {
  int err = 0;
  ssize_t n;
  do {
    n = read(fd, &err, sizeof err);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof err) ? err : 0;
}

int open_max() {
  struct rlimit rl {};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 65536;
  return static_cast<int>(std::min<rlim_t>(rl.rlim_cur, 1 << 20));
}

}  // namespace

pid_t spawn_process(const std::vector<std::string>& command, const std::vector<std::string>& env, int out_fd,
                    int err_fd) {
  int status[2];
  if (pipe2(status, O_CLOEXEC) != 0) throw SpawnError(std::string("pipe2: ") + std::strerror(errno));
  ExecPlan plan;
  plan.argv = c_strings(command);
  plan.envp = c_strings(env);
  plan.devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  plan.out_fd = out_fd;
  plan.err_fd = err_fd;
  plan.status_fd = status[1];
  plan.parent = getpid();
  plan.max_fd = open_max();

  // Block signals across fork so that fsdprun's handlers never run in the child
  // (they would write into fsdprun's self-pipe); the child resets and unblocks them.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = fork();
  if (pid == 0) exec_child(plan);
  const int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  close(status[1]);
  if (plan.devnull >= 0) close(plan.devnull);
  if (pid < 0) {
    close(status[0]);
    throw SpawnError(std::string("fork: ") + std::strerror(fork_errno));
  }
  setpgid(pid, pid);  // also in the parent, so signalling -pid works right away
  const int exec_errno = read_exec_status(status[0]);
  close(status[0]);
  if (exec_errno != 0) {
    waitpid(pid, nullptr, 0);
    throw SpawnError("cannot execute '" + command[0] + "': " + std::strerror(exec_errno));
  }
  return pid;
}

}  // namespace fsdprun
