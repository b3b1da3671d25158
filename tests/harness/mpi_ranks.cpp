// The harness of multiprocess.h for the MPI backend: the ranks are the processes mpirun
// started, each running this whole test binary. run_distributed(world, body) runs `body` on
// every rank when the MPI job has `world` ranks and does nothing otherwise (ctest runs the
// binary under `mpirun -np W` once per world size), so the same test sources serve both
// backends.
#include "harness/multiprocess.h"

#include <fsdp/distributed.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace testing {

void run_distributed(int world, const std::function<void()>& body, const DistOptions& options) {
  const RendezvousInfo info = rendezvous_info_from_env();
  if (world != info.world_size) return;  // another ctest entry runs this world size
  // Extra environment, as the Gloo harness gives its children; restored afterwards.
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  for (const auto& [key, value] : options.env) {
    const char* old = std::getenv(key.c_str());
    saved.emplace_back(key, old ? std::optional<std::string>(old) : std::nullopt);
    ::setenv(key.c_str(), value.c_str(), 1);
  }
  init_process_group(info, InitOptions().timeout(options.collective_timeout).backend("mpi"));
  try {
    body();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "rank " << info.rank << " of " << world << ": " << e.what();
  }
  destroy_process_group();
  for (const auto& [key, old] : saved) {
    if (old) {
      ::setenv(key.c_str(), old->c_str(), 1);
    } else {
      ::unsetenv(key.c_str());
    }
  }
}

// Rank 0 plays the parent's part (creating and removing shared directories).
bool is_child() { return rendezvous_info_from_env().rank != 0; }

std::string shared_temp_path(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  const char* job = std::getenv("OMPI_MCA_ess_base_jobid");
  return std::string(tmp ? tmp : "/tmp") + "/fsdp-mpi-" + (job ? job : "0") + "-" + name;
}

// MPI must be finalised at exit (mpirun reports a rank that ends without it as failed), so
// ranks leave through exit(), which runs the MPI backend's exit handler.
void exit_child(int code) { std::exit(code); }

}  // namespace testing
}  // namespace fsdp
