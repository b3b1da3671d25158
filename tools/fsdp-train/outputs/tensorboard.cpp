// tensorboard.cpp — Event messages (proto/, compiled by protoc) framed as TFRecords.
#include "outputs/tensorboard.h"

#include "outputs/tfrecord.h"

#include "outputs/proto/tensorboard_event.pb.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <stdexcept>

namespace fsdp {
namespace train {
namespace {

namespace pb = fsdp_train::tensorboard;

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

pb::Event event_at(int64_t step) {
  pb::Event e;
  e.set_wall_time(wall_time());
  e.set_step(step);
  return e;
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// TensorBoard finds event files by "tfevents" in the name; time, host and pid keep two runs
// writing into one folder apart.
std::string event_file_name() {
  const auto seconds = static_cast<int64_t>(wall_time());
  return "events.out.tfevents." + std::to_string(seconds) + "." + host_name() + "." + std::to_string(getpid());
}

// A markdown code block around `text`, with a fence longer than any run of backticks in it.
std::string code_block(const std::string& text, const std::string& language) {
  std::string fence = "```";
  while (text.find(fence) != std::string::npos) fence += "`";
  std::string block = fence + language + "\n" + text;
  if (!text.empty() && text.back() != '\n') block += "\n";
  return block + fence + "\n";
}

}  // namespace

void TensorBoardWriter::open(const std::string& dir, int64_t first_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  path_ = (std::filesystem::path(dir) / event_file_name()).string();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  if (ec || !out_) {
    throw std::runtime_error(path_ + ": cannot write the TensorBoard event file (logging.tensorboard_dir: " + dir +
                             (ec ? ": " + ec.message() : std::string()) +
                             "); give a writable folder, or an empty value to write none");
  }
  pb::Event version = event_at(first_step);
  version.set_file_version("brain.Event:2");
  write_record(version.SerializeAsString());
  pb::Event start = event_at(first_step);
  start.mutable_session_log()->set_status(pb::SessionLog::START);
  write_record(start.SerializeAsString());
}

void TensorBoardWriter::step(const StepReport& r, int rank) {
  if (!is_open()) return;
  const RankStep& mine = r.ranks.at(rank);
  pb::Event e = event_at(r.step);
  pb::Summary* summary = e.mutable_summary();
  const auto add = [summary](const char* tag, double value) {
    pb::Summary::Value* v = summary->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  };
  add("train/loss", r.loss);
  add("train/lr", r.lr);
  add("train/grad_norm", r.grad_norm);
  add("train/tokens_per_s", r.tokens_per_s);
  if (r.loss_scale > 0) add("train/loss_scale", r.loss_scale);
  add("time/step_s", r.step_s);
  add("time/forward_s", r.forward_s);
  add("time/backward_s", r.backward_s);
  add("time/optimizer_s", r.optimizer_s);
  add("memory/live_mib", mine.live_mib);
  add("memory/peak_mib", mine.peak_mib);
  add("memory/rss_mib", mine.rss_mib);
  write_record(e.SerializeAsString());
}

void TensorBoardWriter::eval_loss(int64_t step, double loss) { scalar(kEvalLossTag, step, loss); }

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
  if (!is_open()) return;
  pb::Event e = event_at(step);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  write_record(e.SerializeAsString());
}

// The text plugin's form: a rank-0 string tensor whose metadata names the "text" plugin.
void TensorBoardWriter::text(const std::string& tag, int64_t step, const std::string& markdown) {
  if (!is_open()) return;
  pb::Event e = event_at(step);
  pb::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  pb::SummaryMetadata* meta = v->mutable_metadata();
  meta->mutable_plugin_data()->set_plugin_name("text");
  meta->set_data_class(pb::DATA_CLASS_TENSOR);
  pb::TensorProto* tensor = v->mutable_tensor();
  tensor->set_dtype(pb::DT_STRING);
  tensor->mutable_tensor_shape();  // present and empty: a scalar
  tensor->add_string_val(markdown);
  write_record(e.SerializeAsString());
}

void TensorBoardWriter::write_record(const std::string& event_bytes) {
  out_ << tfrecord_frame(event_bytes) << std::flush;
  if (!out_) throw std::runtime_error(path_ + ": writing the TensorBoard event file failed (logging.tensorboard_dir)");
}

std::string config_markdown(const TrainConfig& cfg) {
  std::ostringstream md;
  const TrainConfig::Source& s = cfg.source;
  if (s.path.empty()) md << "No config file: the built-in defaults.\n\n";
  else md << "Config file `" << s.path << "`:\n\n" << code_block(s.text, "yaml") << "\n";
  if (s.overrides.empty()) {
    md << "No command-line overrides.\n";
  } else {
    md << "Command-line overrides, applied in this order:\n\n";
    std::string lines;
    for (const auto& o : s.overrides) lines += o + "\n";
    md << code_block(lines, "");
  }
  return md.str();
}

}  // namespace train
}  // namespace fsdp
