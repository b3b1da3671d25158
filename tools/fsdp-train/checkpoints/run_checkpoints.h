// run_checkpoints.h — a run's checkpoints: the directory checked and locked at start-up, resume
// (rank 0 chooses, every rank loads the same checkpoint or every rank stops), saves in the
// foreground and in the background in the configured format (fsdp_config.checkpoint_format),
// and the last complete checkpoint a stop names. The key layout is checkpoint_state.h's, the
// choice of checkpoint resume.h's, the DCP directories dcp_checkpoints.h's.
#pragma once

#include "checkpoints/checkpoint_state.h"
#include "checkpoints/run_lock.h"
#include "config/config.h"

#include <fsdp/checkpoint.h>
#include <fsdp/device_mesh.h>
#include <torch/nn/module.h>

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace fsdp {
namespace train {

// What a checkpoint holds, as the run has it.
struct TrainingState {
  torch::nn::Module& model;
  torch::optim::Optimizer& optimizer;
  const DeviceMesh& mesh;
  GradScaler* scaler = nullptr;  // fp16: true only
};

class RunCheckpoints {
 public:
  using Printer = std::function<void(const std::string&)>;
  // `identity` (run_identity.h) is recorded with every checkpoint and checked on resume: auto.
  // `print` shows rank 0's lines.
  RunCheckpoints(const TrainConfig& cfg, std::map<std::string, std::string> identity, Printer print);

  // Collective: at start-up rather than at the first save, which can be hours in. Rank 0
  // creates the directory, writes a probe file and takes the directory's lock (run_lock.h);
  // every rank throws ConfigError naming fsdp_config.checkpoint_dir when that fails.
  void check_dir();

  // Collective: training.resume. Rank 0 chooses and says what it found; every rank loads the
  // same checkpoint into `state`, or every rank throws naming the ranks that could not (rank 0
  // with resume.h's unusable_checkpoint_message: the older complete checkpoint and how to
  // continue from it by hand). A run that stops here has saved and pruned nothing. Returns the
  // counters loaded (zero when starting from step 0). `tokens_per_step` gives the token count
  // of a DCP checkpoint, which keeps none.
  TrainerCounters resume(const TrainingState& state, int64_t tokens_per_step);

  // Collective: saves `step` now and returns the directory written.
  std::string save(int64_t step, const TrainingState& state, const TrainerCounters& counters);
  // Collective: starts saving `step` while training goes on (a DCP checkpoint is written in the
  // foreground: save_dcp has no background writer). A failure shows in save_error() after poll().
  void save_in_background(int64_t step, const TrainingState& state, const TrainerCounters& counters);
  // Not collective, never blocks or throws: notes a failed background save in save_error().
  void poll();
  // Waits for a background save; throws its error.
  void wait();
  // After any background save has ended: the newest complete checkpoint as rank 0 sees it
  // ("none" when there is none; "" on the other ranks). Every checkpoint saved holds finite
  // values only: a non-finite step is never applied.
  std::string last_good();

  const std::string& save_error() const { return save_error_; }
  int64_t background_step() const { return background_step_; }
  int64_t last_saved_step() const { return last_saved_step_; }
  // The checkpoint of last_saved_step() when resumed from or saved in the foreground.
  const std::string& last_saved_dir() const { return last_saved_dir_; }

 private:
  bool dcp_format() const { return cfg_.fsdp_config.checkpoint_format == "dcp"; }
  std::string agreed_resume_dir();
  TrainerCounters load(const std::string& dir, const TrainingState& state, int64_t tokens_per_step);
  std::string save_dcp(int64_t step, const TrainingState& state, int64_t steps_done);

  const TrainConfig& cfg_;
  const std::map<std::string, std::string> identity_;
  const Printer print_;
  const int rank_;
  CheckpointDirLock dir_lock_;  // rank 0's, held until the run ends (released after manager_'s last save)
  std::unique_ptr<CheckpointManager> manager_;
  int64_t last_saved_step_ = -1;
  std::string last_saved_dir_;
  int64_t background_step_ = -1;  // the step the latest background save is writing
  std::string save_error_;        // this rank's failed background save, as poll() reported it
};

}  // namespace train
}  // namespace fsdp
