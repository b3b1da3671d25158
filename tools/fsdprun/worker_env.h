// The environment contract between fsdprun and its workers (the same as torchrun's).
#pragma once

#include "options.h"

#include <string>
#include <vector>

namespace fsdprun {

// fsdprun's own environment plus RANK, LOCAL_RANK, WORLD_SIZE, ... for one worker.
// master_port is the store's actual port (chosen by fsdprun with --standalone).
std::vector<std::string> worker_environment(const Options& opt, int local_rank, int attempt, int master_port);

// True when fsdprun sets OMP_NUM_THREADS=1 for the workers (several workers per node
// and the user did not choose a value), so that main can print a note once.
bool sets_omp_num_threads(const Options& opt);

}  // namespace fsdprun
