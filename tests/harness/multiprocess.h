// multiprocess.h — runs a test body in W real processes on loopback.
//
//   TEST(Collectives, AllReduce) {
//     for (int world : {1, 2, 3, 4}) {
//       fsdp::testing::run_distributed(world, [] {
//         auto pg = fsdp::world();
//         ...  // ordinary gtest assertions; fsdp::get_rank() tells which rank this is
//       });
//     }
//   }
//
// In the test process, run_distributed hosts a fresh rendezvous store on a free loopback port
// and starts `world` new processes of this same test binary (never fork() without exec: the
// parent already runs LibTorch threads), each filtered to the current test and told which
// run_distributed call to execute, with torchrun's environment (RANK, WORLD_SIZE, MASTER_PORT,
// ...). Each child calls fsdp::init_process_group(), runs the body, and exits with its gtest
// result. The parent waits, and reports every failed rank with its exit status and its output.
// Two suites can run at once: every call picks its own port.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <string>

namespace fsdp {
namespace testing {

struct DistOptions {
  // Timeout of every collective in the children (FSDP_COLLECTIVE_TIMEOUT_MS).
  std::chrono::milliseconds collective_timeout{60000};
  // The whole call: children still running after this are killed and reported.
  std::chrono::seconds deadline{240};
  // After the first child fails, how long the others may still run before being killed.
  std::chrono::seconds grace_after_failure{15};
  // Extra environment for the children.
  std::map<std::string, std::string> env;
};

void run_distributed(int world, const std::function<void()>& body, const DistOptions& options = DistOptions());

// True in a child process started by run_distributed.
bool is_child();

// A path under $TMPDIR (or /tmp) that is the same in the test process and in all its children,
// and different for every test process: for files that one run_distributed call leaves for the
// next. The test body runs again in each child, so only the parent (!is_child()) should create
// or remove such a directory.
std::string shared_temp_path(const std::string& name);

// Called by the test binary's main() after RUN_ALL_TESTS(): children leave without running
// static destructors (LibTorch and Gloo threads can hang process teardown).
[[noreturn]] void exit_child(int code);

}  // namespace testing
}  // namespace fsdp
