// step_control.h — what a run decides about each step, from numbers every rank already holds:
// the per-step vote over the ranks' gathered numbers, the stop rules and their messages, the
// gradient-sync setting of each micro-batch, and when to checkpoint. Pure functions with no
// torch and no communication: every rank computes the same answer because its inputs are the
// same (the all-gather is the caller's, agreement.h), and tests check the rules directly.
#pragma once

#include "config/config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

// One rank's numbers of a step, sent to every rank before the optimizer steps.
struct StepBallot {
  double loss = 0;              // this rank's mean over its micro-batches
  double grad_norm = 0;         // the global norm (all ranks computed the same all-reduced value)
  bool stop_requested = false;  // this rank received SIGTERM/SIGINT
  bool save_failed = false;     // this rank's background save failed
};

// The ballot as the numbers all_gather_numbers sends: kBallotFields per rank.
constexpr size_t kBallotFields = 4;
std::vector<double> ballot_numbers(const StepBallot& ballot);

// What every rank decided about a step from everyone's ballots (the same on every rank).
struct StepVotes {
  double loss = 0;               // the global-batch mean
  double grad_norm = 0;          // rank 0's
  bool non_finite = false;       // any rank's loss or gradient norm is NaN or infinite
  bool loss_non_finite = false;  // any rank's loss is NaN or infinite
  bool stop_requested = false;   // any rank received SIGTERM/SIGINT
  std::vector<int> save_failed;  // the ranks whose background save failed, ascending
  std::vector<double> local_losses;
};

// Counts the ballots of `world` ranks, gathered rank after rank. Throws std::invalid_argument
// when `gathered` does not hold world * kBallotFields numbers (a caller's bug).
StepVotes tally_votes(const std::vector<double>& gathered, int world);

// What happens to a counted step. A non-finite step is never applied, and it wins over a
// failed save; a signal stops the run after the step is applied and saved. Under loss scaling
// (fp16: true) a non-finite gradient norm with finite losses is the scaler's overflow, not a
// failure: the step is "applied" through the scaler, which skips the optimizer step and lowers
// the scale, and the run goes on; a non-finite loss still stops it.
enum class StepVerdict : uint8_t {
  kApply,           // apply, then go on
  kApplyThenStop,   // apply, save, stop: a rank was asked to stop
  kStopNonFinite,   // stop before applying: exit kExitNonFinite
  kStopFailedSave,  // stop before applying: exit kExitError
};
StepVerdict verdict_of(const StepVotes& votes, bool loss_scaling = false);

// How an accumulating step reduces (DataParallelKind: config.h). NO_SHARD all-reduces and
// FULL_SHARD / SHARD_GRAD_OP reduce-scatter only after the last micro-batch (before it, whole
// gradients accumulate on every rank); HSDP reduce-scatters every micro-batch, so only 1/shards
// of the gradients accumulates, and all-reduces across replicas only after the last one.
struct GradientSync {
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;  // read only for kHybrid
};
GradientSync gradient_sync_for(DataParallelKind kind, int64_t micro, int64_t accumulation);

// A checkpoint in the background after `step`: every `interval` steps (0: never), but not after
// the last step, which the end of the run saves in the foreground.
bool background_save_after(int64_t step, int64_t interval, int64_t total_steps);
// The end of the run saves `last_step` unless checkpoints are off or it is saved already.
bool final_save_needed(int64_t interval, int64_t last_saved_step, int64_t last_step);

// A number for a message: NaN and infinities spelled out (a stream writes "-nan").
std::string shown(double v);

// The stop messages. `good_checkpoint` is the newest complete checkpoint ("none" if none).
std::string non_finite_stop_message(int64_t step, const StepVotes& votes, double max_grad_norm,
                                    const std::string& good_checkpoint);
// One rank's line when a background save failed: its own error when it has one, otherwise the
// ranks that failed; rank 0 adds where to resume from.
std::string failed_save_line(int64_t step, const StepVotes& votes, int64_t saving_step, const std::string& own_error,
                             bool is_rank0, const std::string& good_checkpoint);
std::string signal_stop_message(int64_t step, int signal, const std::string& saved_dir);

}  // namespace train
}  // namespace fsdp
