#include "worker_env.h"

#include <cstdlib>
#include <map>

extern char** environ;

namespace fsdprun {
namespace {

std::map<std::string, std::string> current_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string entry = *e;
    const auto eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

}  // namespace

bool sets_omp_num_threads(const Options& opt) {
  return opt.nproc_per_node > 1 && std::getenv("OMP_NUM_THREADS") == nullptr;
}

std::vector<std::string> worker_environment(const Options& opt, int local_rank, int attempt, int master_port) {
  auto env = current_environment();
  const int rank = opt.node_rank * opt.nproc_per_node + local_rank;
  env["RANK"] = std::to_string(rank);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["WORLD_SIZE"] = std::to_string(opt.world_size());
  env["LOCAL_WORLD_SIZE"] = std::to_string(opt.nproc_per_node);
  env["GROUP_RANK"] = std::to_string(opt.node_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(opt.nnodes);
  env["ROLE_NAME"] = "default";
  env["ROLE_RANK"] = std::to_string(rank);  // one role: role rank == global rank
  env["ROLE_WORLD_SIZE"] = std::to_string(opt.world_size());
  env["MASTER_ADDR"] = opt.master_addr;
  env["MASTER_PORT"] = std::to_string(master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(opt.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = opt.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  if (sets_omp_num_threads(opt)) env["OMP_NUM_THREADS"] = "1";
  // Debian's LibTorch calls OpenBLAS through the plain BLAS interface, so OpenBLAS ignores
  // at::set_num_threads and would start a thread per CPU in every worker: follow OMP's count.
  if (env.count("OMP_NUM_THREADS") && !std::getenv("OPENBLAS_NUM_THREADS")) {
    env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"];
  }

  std::vector<std::string> out;
  for (const auto& [key, value] : env) out.push_back(key + "=" + value);
  return out;
}

}  // namespace fsdprun
