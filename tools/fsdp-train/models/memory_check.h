// memory_check.h — the trainer's start-up check that this machine can hold the run, asked of the
// planner: before anything is allocated, a model or batch the machine cannot hold stops the run
// at configuration time (exit 2, naming the key that matters most) instead of failing in the
// allocator, or growing until the kernel kills it.
//
// The estimate per rank is the planner's peak tensor bytes of one training step as
// `fsdp-train plan` prints it (on device cuda, the host's peak), read from the family's spec
// (plan_question.h); for sizes beyond any machine a lower bound from the same spec is enough to
// refuse: every parameter's value, gradient and AdamW's two moments sharded over the ranks that
// share it, every stage's kept activations, the step's data. Rule: the estimate per rank times the
// ranks on this machine (LOCAL_WORLD_SIZE) must not exceed MemTotal. The key named is the one
// whose halving lowers the estimate most.
#pragma once

#include "config/config.h"
#include "models/family.h"

#include <fsdp/distributed.h>

#include <cstdint>

namespace fsdp {
namespace train {

// Throws ConfigError as above for the ranks of `env` on this machine. Not collective.
void check_memory(const TrainConfig& cfg, const ModelFamily& family, int64_t seq, const RendezvousInfo& env);

// The same for `world` ranks of which `local_world` share a machine of mem_total_bytes (0:
// unknown, which refuses only estimates beyond 2^63 bytes).
void check_fits_in_memory(const TrainConfig& cfg, const ModelFamily& family, int64_t seq, int world, int local_world,
                          double mem_total_bytes);

// MemTotal from /proc/meminfo, in bytes; 0 when it cannot be read.
double machine_memory_bytes();

}  // namespace train
}  // namespace fsdp
