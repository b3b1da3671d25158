// Starting one worker process with fork + exec.
#pragma once

#include <stdexcept>
#include <string>
#include <sys/types.h>
#include <vector>

namespace fsdprun {

// The program could not be started (not found, not executable, ...).
struct SpawnError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Starts command[0] (looked up in PATH) with the given environment, stdin from
// /dev/null and stdout/stderr on out_fd/err_fd, in a new process group of its own
// (pgid == pid) so that it and its children can be signalled together and a Ctrl-C
// in the terminal reaches only fsdprun, which forwards it once. Returns after the
// exec succeeded; throws SpawnError with the exec error otherwise.
pid_t spawn_process(const std::vector<std::string>& command, const std::vector<std::string>& env, int out_fd,
                    int err_fd);

}  // namespace fsdprun
