// run_checkpoints.cpp — a run's checkpoints (run_checkpoints.h).
#include "checkpoints/run_checkpoints.h"

#include "checkpoints/dcp_checkpoints.h"
#include "checkpoints/resume.h"
#include "common/agreement.h"
#include "common/errors.h"

#include <fsdp/dcp.h>
#include <fsdp/distributed.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <unistd.h>

namespace fsdp {
namespace train {
namespace {

// Why the checkpoint directory cannot take checkpoints ("" when it can): created if needed,
// then a probe file written and removed.
std::string checkpoint_dir_problem(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) return dir + " exists and is not a directory";
  fs::create_directories(dir, ec);
  if (ec) return "cannot create " + dir + " (" + ec.message() + ")";
  const std::string probe = dir + "/.fsdp-train-probe-" + std::to_string(::getpid());
  bool written = false;
  {
    std::ofstream f(probe);
    written = static_cast<bool>(f << "probe\n" << std::flush);
  }
  const int err = errno;
  fs::remove(probe, ec);
  return written ? "" : "cannot write in " + dir + " (" + std::strerror(err) + ")";
}

}  // namespace

RunCheckpoints::RunCheckpoints(const TrainConfig& cfg, std::map<std::string, std::string> identity, Printer print)
    : cfg_(cfg), identity_(std::move(identity)), print_(std::move(print)), rank_(get_rank()) {
  manager_ = std::make_unique<CheckpointManager>(cfg_.fsdp_config.checkpoint_dir,
                                                 static_cast<int>(cfg_.training.keep_checkpoints));
  manager_->set_attributes(identity_);
}

void RunCheckpoints::check_dir() {
  std::string problem;
  if (rank_ == 0) {
    problem = checkpoint_dir_problem(cfg_.fsdp_config.checkpoint_dir);
    if (problem.empty()) problem = dir_lock_.acquire(cfg_.fsdp_config.checkpoint_dir);
  }
  problem = from_rank0(problem);
  if (!problem.empty()) throw ConfigError("fsdp_config.checkpoint_dir: " + problem);
}

TrainerCounters RunCheckpoints::resume(const TrainingState& state, int64_t tokens_per_step) {
  const std::string dir = agreed_resume_dir();
  if (dir.empty()) return {};
  const TrainerCounters counters = load(dir, state, tokens_per_step);
  print_("resumed from " + dir + " at step " + std::to_string(counters.steps_done));
  return counters;
}

// Rank 0's choice, on every rank: "D<dir>", or "C<message>" / "E<message>" for a configuration
// / runtime error that every rank then throws.
std::string RunCheckpoints::agreed_resume_dir() {
  std::string mine;
  if (rank_ == 0) {
    try {
      const ResumeChoice c = resume_choice(cfg_.training.resume, *manager_, cfg_.fsdp_config.checkpoint_dir, identity_,
                                           cfg_.training.allow_resume_mismatch);
      for (const auto& note : c.notes) print_(terminal_safe(note));
      mine = "D" + c.dir;
    } catch (const ConfigError& e) {
      mine = "C" + std::string(e.what());
    } catch (const std::exception& e) {
      mine = "E" + error_text(e);
    }
  }
  const std::string decided = from_rank0(mine);
  const std::string text = decided.substr(1);
  const std::string seen_by = rank_ == 0 ? text : "rank 0 found no checkpoint to resume from (see its message)";
  if (decided[0] == 'C') throw ConfigError(seen_by);
  if (decided[0] == 'E') throw std::runtime_error(seen_by);
  return text;
}

TrainerCounters RunCheckpoints::load(const std::string& dir, const TrainingState& state, int64_t tokens_per_step) {
  std::string why;
  const bool dcp = is_dcp_dir(dir);  // a DCP checkpoint, whatever checkpoint_format this run writes
  const bool readable = dcp ? is_complete_dcp(dir, &why) : CheckpointManager::is_complete(dir, &why);
  throw_unless_every_rank_ok(readable ? "" : why, "cannot resume from " + dir + ", which rank 0 chose");
  std::string problem;
  TrainerCounters counters;
  try {
    if (dcp) {
      // Every step trains tokens_per_step tokens: the count follows from the steps.
      counters.steps_done = load_dcp_state(dir, state.model, state.optimizer);
      counters.tokens_seen = counters.steps_done * tokens_per_step;
    } else {
      counters = load_checkpoint_state(dir, state.model, state.optimizer, state.mesh, state.scaler);
    }
  } catch (const std::exception& e) {
    problem = error_text(e);
  }
  const std::string what = "cannot load the checkpoint " + dir;
  try {
    throw_unless_every_rank_ok(problem, what);
  } catch (const std::runtime_error& e) {
    // The checksums, keys and optimizer are checked only as every rank loads: the same stop as
    // for damage the scan finds (rank 0 says it in full; the other ranks' lines stay short).
    if (rank_ != 0) throw;
    const std::string ranks = std::string(e.what()).substr(what.size() + 2);  // "rank R: ..."
    const std::string setting = cfg_.training.resume == "auto" ? "training.resume: auto: " : "training.resume: ";
    throw std::runtime_error(setting + unusable_checkpoint_message(dir, ranks));
  }
  last_saved_step_ = counters.steps_done;
  last_saved_dir_ = dir;
  return counters;
}

std::string RunCheckpoints::save(int64_t step, const TrainingState& state, const TrainerCounters& counters) {
  const std::string dir =
      dcp_format()
          ? save_dcp(step, state, counters.steps_done)
          : manager_->save(step, checkpoint_state(state.model, state.optimizer, state.mesh, counters, state.scaler));
  last_saved_step_ = step;
  last_saved_dir_ = dir;
  return dir;
}

void RunCheckpoints::save_in_background(int64_t step, const TrainingState& state, const TrainerCounters& counters) {
  if (dcp_format()) {
    save(step, state, counters);
    return;
  }
  manager_->save_async(step, checkpoint_state(state.model, state.optimizer, state.mesh, counters, state.scaler));
  background_step_ = step;
  last_saved_step_ = step;
}

// checkpoint_dir/step_<N> in DCP layout; then rank 0 prunes to training.keep_checkpoints
// (save_dcp returns on every rank only once the checkpoint is complete).
std::string RunCheckpoints::save_dcp(int64_t step, const TrainingState& state, int64_t steps_done) {
  const std::string dir = dcp_step_dir(cfg_.fsdp_config.checkpoint_dir, step);
  save_dcp_state(dir, state.model, state.optimizer, steps_done, cfg_.optimizer.lr);
  if (rank_ == 0) {
    const std::string problems = prune_dcp(cfg_.fsdp_config.checkpoint_dir, cfg_.training.keep_checkpoints, dir);
    if (!problems.empty()) print_("checkpoint: pruning old checkpoints: " + terminal_safe(problems));
  }
  return dir;
}

// A failed background save is noticed at the next step, not at the next save.
void RunCheckpoints::poll() {
  if (!save_error_.empty()) return;
  try {
    manager_->poll();
  } catch (const std::exception& e) {
    save_error_ = error_text(e);
  }
}

void RunCheckpoints::wait() { manager_->wait(); }

std::string RunCheckpoints::last_good() {
  try {
    manager_->wait();
  } catch (const std::exception& e) {
    if (save_error_.empty()) save_error_ = error_text(e);
  }
  if (rank_ != 0) return "";
  const CheckpointManager::Scan scan = manager_->scan();
  const std::optional<std::string> dir =
      dcp_format() ? newest_complete_dcp(cfg_.fsdp_config.checkpoint_dir) : resumable_checkpoint(scan);
  return dir ? *dir : std::string("none");
}

}  // namespace train
}  // namespace fsdp
