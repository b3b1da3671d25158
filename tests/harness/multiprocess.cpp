#include "harness/multiprocess.h"

#include <fsdp/distributed.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

extern char** environ;

namespace fsdp {
namespace testing {
namespace {

constexpr const char* kChildCallVar = "FSDP_TEST_CHILD_CALL";
constexpr const char* kParentPidVar = "FSDP_TEST_PARENT_PID";

// run_distributed calls are numbered within each test, so a child can find "its" call.
int next_call_index() {
  static std::string current_test;
  static int index = 0;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  if (name != current_test) {
    current_test = name;
    index = 0;
  }
  return index++;
}

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;  // the child's stdout and stderr, merged
  std::string output;
  bool exited = false;
  int status = 0;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  }
  return "status " + std::to_string(status);
}

bool failed(const Child& c) { return c.exited && !(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0); }

Child spawn_child(int rank, int world, int port, int call, const DistOptions& options) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; *e; ++e) {
    const char* eq = std::strchr(*e, '=');
    if (eq) vars[std::string(*e, static_cast<size_t>(eq - *e))] = eq + 1;
  }
  vars["RANK"] = std::to_string(rank);
  vars["LOCAL_RANK"] = std::to_string(rank);
  vars["WORLD_SIZE"] = std::to_string(world);
  vars["LOCAL_WORLD_SIZE"] = std::to_string(world);
  vars["MASTER_ADDR"] = "127.0.0.1";
  vars["MASTER_PORT"] = std::to_string(port);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  vars["TORCHELASTIC_RESTART_COUNT"] = "0";
  vars["OMP_NUM_THREADS"] = "1";
  vars["FSDP_COLLECTIVE_TIMEOUT_MS"] = std::to_string(options.collective_timeout.count());
  vars[kChildCallVar] = std::to_string(call);
  vars[kParentPidVar] = std::to_string(::getpid());
  for (const auto& kv : options.env) vars[kv.first] = kv.second;
  std::vector<std::string> env_strings;
  for (const auto& kv : vars) env_strings.push_back(kv.first + "=" + kv.second);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(&s[0]);
  envp.push_back(nullptr);

  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=" + current_test_filter();
  std::vector<char*> argv = {&exe[0], &filter[0], nullptr};

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  posix_spawn_file_actions_adddup2(&actions, fds[1], 2);
  Child child;
  child.rank = rank;
  const int rc = posix_spawn(&child.pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (rc != 0) {
    close(fds[0]);
    throw std::runtime_error(std::string("posix_spawn failed: ") + std::strerror(rc));
  }
  child.out_fd = fds[0];
  return child;
}

// Reads whatever the children printed, and reaps the ones that exited.
void pump(std::vector<Child>& children, int timeout_ms) {
  std::vector<pollfd> fds;
  for (auto& c : children) {
    if (c.out_fd >= 0) fds.push_back({c.out_fd, POLLIN, 0});
  }
  if (!fds.empty()) poll(fds.data(), fds.size(), timeout_ms);
  for (auto& c : children) {
    if (c.out_fd < 0) continue;
    char buf[4096];
    for (;;) {
      pollfd p{c.out_fd, POLLIN, 0};
      if (poll(&p, 1, 0) <= 0) break;
      const ssize_t n = read(c.out_fd, buf, sizeof(buf));
      if (n <= 0) {
        close(c.out_fd);
        c.out_fd = -1;
        break;
      }
      c.output.append(buf, n);
    }
  }
  for (auto& c : children) {
    if (!c.exited && waitpid(c.pid, &c.status, WNOHANG) == c.pid) c.exited = true;
  }
}

std::string tail(const std::string& s, size_t max_chars) {
  return s.size() <= max_chars ? s : "...\n" + s.substr(s.size() - max_chars);
}

void run_in_child(const std::function<void()>& body) {
  fsdp::init_process_group();
  const int rank = fsdp::get_rank();
  try {
    body();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << rank << " threw: " << e.what();
  }
  fsdp::destroy_process_group();
}

}  // namespace

bool is_child() { return std::getenv(kChildCallVar) != nullptr; }

std::string shared_temp_path(const std::string& name) {
  const char* parent = std::getenv(kParentPidVar);
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp && *tmp ? tmp : "/tmp") + "/fsdp_test_" +
         (parent ? std::string(parent) : std::to_string(::getpid())) + "_" + name;
}

void exit_child(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

void run_distributed(int world, const std::function<void()>& body, const DistOptions& options) {
  const int call = next_call_index();
  if (is_child()) {
    if (std::atoi(std::getenv(kChildCallVar)) == call) run_in_child(body);
    return;
  }
  ASSERT_GE(world, 1);
  // The parent plays the launcher's part: it hosts the store, and the children are clients.
  c10d::TCPStoreOptions store_opts;
  store_opts.port = 0;  // any free port
  store_opts.isServer = true;
  store_opts.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", store_opts);
  const int port = store->getPort();

  std::vector<Child> children;
  for (int r = 0; r < world; ++r) children.push_back(spawn_child(r, world, port, call, options));

  const auto start = std::chrono::steady_clock::now();
  auto first_failure = std::chrono::steady_clock::time_point::max();
  bool killed_for_deadline = false;
  for (;;) {
    pump(children, 50);
    bool all_done = true;
    for (auto& c : children) {
      all_done = all_done && c.exited && c.out_fd < 0;
      if (failed(c) && first_failure == std::chrono::steady_clock::time_point::max()) {
        first_failure = std::chrono::steady_clock::now();
      }
    }
    if (all_done) break;
    const auto now = std::chrono::steady_clock::now();
    const bool past_deadline = now - start > options.deadline;
    const bool past_grace = now - first_failure > options.grace_after_failure;
    if (past_deadline || past_grace) {
      killed_for_deadline = killed_for_deadline || past_deadline;
      for (auto& c : children) {
        if (!c.exited) kill(c.pid, SIGKILL);
      }
    }
  }

  for (const auto& c : children) {
    if (!failed(c)) continue;
    ADD_FAILURE() << "rank " << c.rank << " of " << world << " failed (" << describe_status(c.status)
                  << (killed_for_deadline ? ", killed at the deadline" : "") << "). Its output:\n"
                  << tail(c.output, 6000);
  }
}

}  // namespace testing
}  // namespace fsdp
