// The size limits of a run, and the process resources fsdprun needs for its size.
#pragma once

#include "options.h"

namespace fsdprun {

// Upper bounds of --nproc-per-node and of the world size (--nnodes x --nproc-per-node).
// Far above what a node runs (one worker per GPU or per core), they catch a mistyped
// number before fsdprun spends minutes forking: each worker costs a fork of fsdprun
// (a few ms, with LibTorch mapped), two pipes, and on node 0 the store's connections.
constexpr int kMaxNprocPerNode = 1024;
constexpr long long kMaxWorldSize = 1 << 20;

// Upper bounds of the durations fsdprun takes (seconds): a grace period or polling interval
// over an hour, or a join timeout over a week, is a mistyped number, and a huge one would
// overflow the clocks fsdprun computes deadlines with.
constexpr double kMaxIntervalS = 3600;
constexpr double kMaxJoinTimeoutS = 7 * 24 * 3600;

// Raises the soft limit of open files (RLIMIT_NOFILE) towards what this node needs:
// two pipes per local worker and, on node 0, the store's connections of every rank and
// agent. Best effort, up to the hard limit; workers inherit the raised limit. Does
// nothing when the current limit suffices.
void raise_open_file_limit(const Options& opt);

}  // namespace fsdprun
