// plan_question.h — a TrainConfig as fsdp::plan's question (fsdp/plan.h): the family's spec with
// its sizes, the activations, the sharding and the options, as the trainer would run it.
// `fsdp-train plan` prints the answer; the trainer's start-up memory check (memory_check.h)
// holds it against the machine. No collectives, no tensors.
#pragma once

#include "config/config.h"
#include "models/family.h"

#include <fsdp/plan.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

struct PlanQuestion {
  std::vector<PlanSize> sizes;  // the family's (ModelFamily::plan_sizes), which a caller may vary
  plan::ActivationOptions activations;
  plan::TransformerSharding sharding;
  plan::PlanOptions options;
  std::string strategy;
  DataParallelShape mesh;
  std::string backend;             // and why: "gloo", "mpi (FSDP_BACKEND)", ...
  std::string threads;             // how the ranks' threads are set, for the step time
  double resident_data_bytes = 0;  // a token file, held whole by every rank for the whole run
};

// The question of `cfg` at sequence length `seq` (seq_len_of), `world` ranks of which
// `local_world` share a machine. Throws ConfigError for what the trainer refuses (check_supported,
// the data-parallel shape) and an unreadable --constants file. `strict` (`fsdp-train plan`): also
// for a token file it cannot count, and for what the planner does not model
// (fsdp_config.reshard_after_forward's group size, prefetch_depth, model.freeze). Without it (the start-up memory
// check) those are planned as if absent: no resident tokens, full resharding, every parameter
// trained. `evaluation`: what `fsdp-train eval` needs instead of a training step (eval.path's
// tokens resident, every layer without grad; throws ConfigError when eval.path is empty or not a
// token file).
PlanQuestion plan_question(const TrainConfig& cfg, const ModelFamily& family, int64_t seq, int world, int local_world,
                           bool strict, const std::string& constants_file = "", bool evaluation = false);

// The family's spec for the question, its sizes as given (a caller varies them in a copy).
plan::ModelSpec model_spec_of(const ModelFamily& family, const PlanQuestion& q);
// The plan. Throws ConfigError with what the planner refuses.
plan::Plan plan_of(const ModelFamily& family, const PlanQuestion& q);
// The whole model's parameters, as the spec counts them (a tied weight once).
int64_t parameter_count(const ModelFamily& family, const PlanQuestion& q);

}  // namespace train
}  // namespace fsdp
