// tensorboard.h — rank 0's TensorBoard event file (logging.tensorboard_dir): each applied step's
// scalars, the eval loss, and the run's configuration as text, in the format TensorBoard reads
// (protobuf Event messages, encoded here in protobuf's wire format with TensorBoard's field
// numbers, in TFRecord framing, tfrecord.h). Point TensorBoard at the folder:
//   tensorboard --logdir <logging.tensorboard_dir>
// Each run (a resumed one too) writes a file of its own, events.out.tfevents.<time>.<host>.<pid>,
// and opens it with a session start, so that TensorBoard drops what an earlier file holds of
// the steps the run trains again. Every event is flushed when written: a killed run keeps them.
// No torch and no protobuf library here.
#pragma once

#include "config/config.h"
#include "outputs/report.h"

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace train {

// The scalars of one applied step (the JSONL key each mirrors in brackets):
//   train/loss (loss, the global-batch mean), train/lr (lr), train/grad_norm (grad_norm),
//   train/tokens_per_s (tokens_per_s), train/loss_scale (loss_scale, fp16: true only),
//   time/step_s, time/forward_s, time/backward_s, time/optimizer_s (step_s, forward_s, ...),
//   memory/live_mib, memory/peak_mib, memory/rss_mib (rank 0's live_mib, peak_mib, rss_mib).
// TensorBoard stores scalars as 32-bit floats.
constexpr const char* kEvalLossTag = "eval/loss";
constexpr const char* kConfigTag = "config";

class TensorBoardWriter {
 public:
  TensorBoardWriter() = default;  // not open: every write does nothing
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Creates `dir` and a new event file in it, and writes the file's version event and a session
  // start at step first_step (the first step this run trains). Throws std::runtime_error naming
  // the file and logging.tensorboard_dir when it cannot be written.
  void open(const std::string& dir, int64_t first_step);
  bool is_open() const { return out_.is_open(); }
  const std::string& path() const { return path_; }

  // The scalars above of step r.step, with this rank's memory.
  void step(const StepReport& r, int rank);
  // The loss on the held-out data after step `step`, as eval/loss.
  void eval_loss(int64_t step, double loss);
  // One scalar; `tag` groups by its prefix before "/" in TensorBoard's Scalars tab.
  void scalar(const std::string& tag, int64_t step, double value);
  // Markdown shown in TensorBoard's Text tab.
  void text(const std::string& tag, int64_t step, const std::string& markdown);

 private:
  void write_record(const std::string& event_bytes);
  std::ofstream out_;
  std::string path_;
};

// The Event messages the writer frames, as bytes of tensorboard.Event (public for the tests, which
// compare them with what protoc's code writes): each has `wall_time` (seconds since the epoch)
// and `step`.
namespace tensorboard_events {
// The file's first event: file_version "brain.Event:2".
std::string file_version(double wall_time, int64_t step);
// A SessionLog START: TensorBoard drops what earlier files hold of steps at or after `step`.
std::string session_start(double wall_time, int64_t step);
// One Summary of simple_value scalars, in the order given.
std::string scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values);
// The text plugin's summary: `markdown` as a scalar string tensor under `tag`.
std::string text(double wall_time, int64_t step, const std::string& tag, const std::string& markdown);
}  // namespace tensorboard_events

// The run's configuration as markdown for the Text tab: the config file's path and text, and
// the command-line overrides applied after it, in order.
std::string config_markdown(const TrainConfig& cfg);

}  // namespace train
}  // namespace fsdp
