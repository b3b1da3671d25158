// step_control.cpp — the per-step vote, the stop rules and their messages (step_control.h).
#include "run/step_control.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

namespace fsdp {
namespace train {

std::vector<double> ballot_numbers(const StepBallot& b) {
  return {b.loss, b.grad_norm, b.stop_requested ? 1.0 : 0.0, b.save_failed ? 1.0 : 0.0};
}

StepVotes tally_votes(const std::vector<double>& gathered, int world) {
  if (world < 1 || gathered.size() != static_cast<size_t>(world) * kBallotFields)
    throw std::invalid_argument("tally_votes: " + std::to_string(gathered.size()) + " numbers for " +
                                std::to_string(world) + " rank(s); expected " + std::to_string(kBallotFields) +
                                " per rank");
  StepVotes v;
  v.grad_norm = gathered[1];
  for (int q = 0; q < world; ++q) {
    const double* p = gathered.data() + static_cast<size_t>(q) * kBallotFields;
    v.local_losses.push_back(p[0]);
    v.loss += p[0] / world;
    v.non_finite = v.non_finite || !std::isfinite(p[0]) || !std::isfinite(p[1]);
    v.loss_non_finite = v.loss_non_finite || !std::isfinite(p[0]);
    v.stop_requested = v.stop_requested || p[2] != 0.0;
    if (p[3] != 0.0) v.save_failed.push_back(q);
  }
  return v;
}

StepVerdict verdict_of(const StepVotes& votes, bool loss_scaling) {
  if (loss_scaling ? votes.loss_non_finite : votes.non_finite) return StepVerdict::kStopNonFinite;
  if (!votes.save_failed.empty()) return StepVerdict::kStopFailedSave;
  if (votes.stop_requested) return StepVerdict::kApplyThenStop;
  return StepVerdict::kApply;
}

GradientSync gradient_sync_for(DataParallelKind kind, int64_t micro, int64_t accumulation) {
  const bool last = micro == accumulation - 1;
  GradientSync s;
  if (kind == DataParallelKind::kHybrid) {
    s.requires_gradient_sync = true;
    s.requires_all_reduce = last;
  } else {
    s.requires_gradient_sync = last;
  }
  return s;
}

bool background_save_after(int64_t step, int64_t interval, int64_t total_steps) {
  return interval > 0 && step % interval == 0 && step < total_steps;
}

bool final_save_needed(int64_t interval, int64_t last_saved_step, int64_t last_step) {
  return interval > 0 && last_saved_step != last_step;
}

std::string shown(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream s;
  s << v;
  return s.str();
}

std::string non_finite_stop_message(int64_t step, const StepVotes& votes, double max_grad_norm,
                                    const std::string& good_checkpoint) {
  std::ostringstream msg;
  msg << "fsdp-train: stopping at step " << step << ": the loss is " << shown(votes.loss)
      << " and the gradient norm is " << shown(votes.grad_norm)
      << " (non-finite); this step was not applied (no optimizer step) and nothing of it is "
      << "saved. The last good checkpoint is " << good_checkpoint << ". Lower optimizer.lr";
  if (max_grad_norm > 0) msg << " (clipping at training.max_grad_norm cannot help a non-finite norm)";
  else msg << " or set training.max_grad_norm (clipping is off)";
  msg << ", then run again with training.resume: auto.";
  return msg.str();
}

std::string failed_save_line(int64_t step, const StepVotes& votes, int64_t saving_step, const std::string& own_error,
                             bool is_rank0, const std::string& good_checkpoint) {
  std::string ranks;
  for (int q : votes.save_failed) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
  const std::string saved = "the checkpoint of step " + std::to_string(saving_step);
  std::string line = !own_error.empty() ? "saving " + saved + " failed: " + own_error
                                        : "stopping at step " + std::to_string(step) + ": rank(s) " + ranks +
                                              " failed saving " + saved;
  if (is_rank0)
    line += "; stopped at step " + std::to_string(step) + " (not applied); the last complete checkpoint is " +
            good_checkpoint + ": fix the cause and run again with training.resume: auto";
  return line;
}

std::string signal_stop_message(int64_t step, int signal, const std::string& saved_dir) {
  return "fsdp-train: stop requested (signal " + std::to_string(signal) + "): saved step " + std::to_string(step) +
         " to " + saved_dir + "; run again with training.resume: auto to continue";
}

}  // namespace train
}  // namespace fsdp
