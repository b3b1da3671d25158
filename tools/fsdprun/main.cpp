// fsdprun: the C++ counterpart of torchrun. See README.md in this directory.
#include "agent.h"
#include "flight_dumps.h"
#include "options.h"
#include "output.h"
#include "signals.h"
#include "worker_env.h"

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <string>

namespace {

// Leaves without running global destructors. fsdprun has nothing to clean up there
// (pipes and workers are gone by now; the store is left to the exit, see main), while
// the destructors of LibTorch's ~280 dependent libraries take about half a second, on
// every run.
[[noreturn]] void leave(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}

// Everything before the agent; returns the exit code when there is nothing to run.
std::optional<int> prepare(const fsdprun::ParseResult& parsed) {
  if (!parsed.ok) return parsed.exit_code;
  try {
    fsdprun::SignalPipe::install();
  } catch (const std::exception& e) {
    const std::string line = std::string("fsdprun: error: ") + e.what() + "\n";
    fsdprun::write_all(2, line.data(), line.size());
    return 1;
  }
  if (fsdprun::sets_omp_num_threads(parsed.options)) {
    const std::string note =
        "fsdprun: note: OMP_NUM_THREADS is set to 1 for each worker to avoid oversubscribing the CPU; "
        "set it yourself to tune\n";
    fsdprun::write_all(2, note.data(), note.size());
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  fsdprun::ParseResult parsed = fsdprun::parse_options(argc, argv);
  if (parsed.ok && parsed.options.dump_pid != 0) leave(fsdprun::request_dumps(parsed.options.dump_pid));
  if (auto exit_code = prepare(parsed)) leave(*exit_code);
  // The agent is never destroyed: leave() exits from inside its scope. Destroying the
  // store it hosts would join the store's server thread, which may be waiting in the
  // middle of a client's request; the workers are gone by now, nothing else is owed.
  fsdprun::Agent agent(std::move(parsed.options));
  leave(agent.run());
}
