#include "worker_group.h"

#include "signals.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

namespace fsdprun {

struct WorkerGroup::Worker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool reaped = false;
  WorkerExit exit;
  int fds[2] = {-1, -1};  // read ends of the stdout / stderr pipes, -1 once at EOF
  std::unique_ptr<StreamSink> sinks[2];
};

namespace {

struct Pipe {
  int read = -1;
  int write = -1;
};

Pipe make_pipe() {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    const bool too_many = errno == EMFILE || errno == ENFILE;
    throw SpawnError(std::string("pipe2: ") + std::strerror(errno) +
                     (too_many ? " (the open-file limit, ulimit -n, is too low for this many workers)" : ""));
  }
  fcntl(fds[0], F_SETFL, O_NONBLOCK);  // fsdprun never blocks on one worker's output
  return {fds[0], fds[1]};
}

WorkerExit decode_status(int status) {
  WorkerExit e;
  if (WIFSIGNALED(status)) {
    e.signaled = true;
    e.value = WTERMSIG(status);
  } else {
    e.value = WEXITSTATUS(status);
  }
  return e;
}

// Reads what is available now; returns false at EOF or on a read error.
bool read_available(int fd, StreamSink& sink) {
  char buf[16384];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n > 0) {
      sink.consume(buf, static_cast<std::size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
  }
}

}  // namespace

std::string WorkerExit::describe() const {
  if (signaled) return "was killed by signal " + signal_name(value) + " (" + std::to_string(value) + ")";
  return "exited with code " + std::to_string(value);
}

std::string WorkerFailure::describe() const {
  return "rank " + std::to_string(rank) + " (local_rank " + std::to_string(local_rank) + ", pid " +
         std::to_string(pid) + ") " + how.describe();
}

WorkerGroup::WorkerGroup(GroupSpec spec) : spec_(std::move(spec)) {}

WorkerGroup::~WorkerGroup() {
  if (running()) kill_now();
  for (auto& w : workers_) {
    if (!w->reaped) waitpid(w->pid, nullptr, 0);
    w->reaped = true;
  }
  finish_output();
}

bool WorkerGroup::start(const std::function<bool()>& keep_going) {
  static const char* kStreams[2] = {"stdout", "stderr"};
  for (const WorkerSpec& ws : spec_.workers) {
    if (!keep_going()) return false;
    auto w = std::make_unique<Worker>();
    w->rank = ws.rank;
    w->local_rank = ws.local_rank;
    Pipe pipes[2] = {make_pipe(), make_pipe()};
    for (int s = 0; s < 2; ++s) {
      w->fds[s] = pipes[s].read;
      const std::string prefix = spec_.prefix ? "[rank" + std::to_string(ws.rank) + "]:" : "";
      const std::string log =
          spec_.log_dir.empty() ? "" : log_file_path(spec_.log_dir, spec_.attempt, ws.rank, kStreams[s]);
      w->sinks[s] = std::make_unique<StreamSink>(prefix, spec_.console ? s + 1 : -1, log);
    }
    try {
      w->pid = spawn_process(spec_.command, ws.env, pipes[0].write, pipes[1].write);
    } catch (...) {
      for (auto& p : pipes) close(p.write);
      for (int fd : w->fds) close(fd);
      throw;  // the destructor stops the workers already started
    }
    for (auto& p : pipes) close(p.write);  // EOF on the read end once the worker is gone
    workers_.push_back(std::move(w));
  }
  return true;
}

void WorkerGroup::drain(Worker& w) {
  for (int s = 0; s < 2; ++s) {
    if (w.fds[s] < 0 || read_available(w.fds[s], *w.sinks[s])) continue;
    close(w.fds[s]);
    w.fds[s] = -1;
    w.sinks[s]->finish();
  }
}

void WorkerGroup::pump(int timeout_ms, const std::vector<int>& wake_fds) {
  std::vector<pollfd> fds;
  std::vector<Worker*> owners;
  for (auto& w : workers_) {
    for (int fd : w->fds) {
      if (fd < 0) continue;
      fds.push_back({fd, POLLIN, 0});
      owners.push_back(w.get());
    }
  }
  for (int fd : wake_fds) fds.push_back({fd, POLLIN, 0});     // poll() skips negative fds
  if (poll(fds.data(), fds.size(), timeout_ms) <= 0) return;  // timeout or EINTR
  for (std::size_t i = 0; i < owners.size(); ++i) {
    if (fds[i].revents != 0) drain(*owners[i]);
  }
}

std::vector<WorkerFailure> WorkerGroup::reap() {
  std::vector<WorkerFailure> failures;
  for (auto& w : workers_) {
    int status = 0;
    if (w->reaped || waitpid(w->pid, &status, WNOHANG) != w->pid) continue;
    w->reaped = true;
    w->exit = decode_status(status);
    drain(*w);  // its last words come before any report about it
    if (!w->exit.ok() && !stopping_) failures.push_back({w->rank, w->local_rank, w->pid, w->exit});
  }
  return failures;
}

bool WorkerGroup::running() const {
  for (const auto& w : workers_)
    if (!w->reaped) return true;
  return false;
}

// Signals the process group of every worker, reaped or not: a worker's own children
// (in its group) are stopped too. A pgid is not reused while any member is alive, so
// this cannot hit unrelated processes. The group reaches the worker itself once; its pid
// is signalled as well only if it moved to another process group, because a second
// SIGTERM delivered after the worker handled the first means "stop at once" to the trainer.
void WorkerGroup::signal_all(int signo) {
  for (auto& w : workers_) {
    kill(-w->pid, signo);
    if (!w->reaped && getpgid(w->pid) != w->pid) kill(w->pid, signo);
  }
}

void WorkerGroup::stop(int signo, double grace_s) {
  stopping_ = true;
  signal_all(signo);
  const auto grace = std::chrono::duration<double>(grace_s);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(grace);
  if (kill_deadline_ == std::chrono::steady_clock::time_point{} || deadline < kill_deadline_) kill_deadline_ = deadline;
}

void WorkerGroup::kill_now() {
  if (workers_.empty()) return;
  stopping_ = true;
  killed_ = true;
  signal_all(SIGKILL);
}

int WorkerGroup::enforce_deadline() {
  if (!stopping_ || killed_ || kill_deadline_ == std::chrono::steady_clock::time_point{}) return -1;
  const auto left = kill_deadline_ - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) {
    kill_now();
    return -1;
  }
  return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(left).count()) + 1;
}

void WorkerGroup::finish_output() {
  for (auto& w : workers_) {
    drain(*w);
    for (int s = 0; s < 2; ++s) {
      if (w->fds[s] >= 0) close(w->fds[s]);
      w->fds[s] = -1;
      if (w->sinks[s]) w->sinks[s]->finish();
    }
  }
}

std::vector<std::pair<int, pid_t>> WorkerGroup::unreaped() const {
  std::vector<std::pair<int, pid_t>> out;
  for (const auto& w : workers_)
    if (!w->reaped) out.emplace_back(w->rank, w->pid);
  return out;
}

std::vector<std::pair<int, std::string>> WorkerGroup::exits() const {
  std::vector<std::pair<int, std::string>> out;
  for (const auto& w : workers_)
    if (w->reaped) out.emplace_back(w->rank, w->exit.describe());
  return out;
}

}  // namespace fsdprun
