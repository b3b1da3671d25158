#include "run_limits.h"

#include <algorithm>
#include <sys/resource.h>

namespace fsdprun {
namespace {

// Descriptors fsdprun holds apart from its workers' (stdio, the self-pipe, LibTorch's own).
constexpr rlim_t kBaseFiles = 256;
// What one client of the store costs on node 0, at most: a TCPStore client's connection for
// requests, and the one for key-watch callbacks that older LibTorch clients opened as well.
constexpr rlim_t kStoreFilesPerClient = 2;

rlim_t files_needed(const Options& opt) {
  rlim_t n = kBaseFiles + 2 * static_cast<rlim_t>(opt.nproc_per_node);  // stdout and stderr pipes
  if (opt.node_rank == 0)
    n += kStoreFilesPerClient * (static_cast<rlim_t>(opt.world_size()) + static_cast<rlim_t>(opt.nnodes));
  return n;
}

}  // namespace

void raise_open_file_limit(const Options& opt) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  const rlim_t needed = files_needed(opt);
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= needed) return;
  rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? needed : std::min(needed, rl.rlim_max);
  setrlimit(RLIMIT_NOFILE, &rl);
}

}  // namespace fsdprun
