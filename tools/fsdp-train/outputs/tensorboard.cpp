// tensorboard.cpp — Event messages in protobuf's wire format, written here, framed as TFRecords.
#include "outputs/tensorboard.h"

#include "outputs/tfrecord.h"

#include <unistd.h>

#include <chrono>
#include <bit>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

namespace fsdp {
namespace train {
namespace {

// Protobuf's wire format, as much of it as an event file needs: a field is a key (its number
// and wire type as a varint), then a varint, 8 or 4 little-endian bytes, or a length and bytes.
// Fields are written in field-number order, and a proto3 scalar at its default is left out, as
// protobuf's own serializer does, so the bytes are the ones protoc's code would write.
class Message {
 public:
  Message& varint(int field, uint64_t v) {
    key(field, kVarint);
    put_varint(v);
    return *this;
  }
  Message& float64(int field, double v) {
    key(field, kFixed64);
    put_le(std::bit_cast<uint64_t>(v), 8);
    return *this;
  }
  Message& float32(int field, float v) {
    key(field, kFixed32);
    put_le(std::bit_cast<uint32_t>(v), 4);
    return *this;
  }
  Message& bytes(int field, std::string_view v) {
    key(field, kLengthDelimited);
    put_varint(v.size());
    out_.append(v);
    return *this;
  }
  Message& message(int field, const Message& m) { return bytes(field, m.out_); }
  const std::string& str() const { return out_; }

 private:
  enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };
  void key(int field, WireType type) { put_varint((static_cast<uint64_t>(field) << 3) | type); }
  void put_varint(uint64_t v) {
    for (; v >= 0x80; v >>= 7) out_.push_back(static_cast<char>((v & 0x7F) | 0x80));
    out_.push_back(static_cast<char>(v));
  }
  void put_le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  }
  std::string out_;
};

// TensorBoard's field numbers and enum values (tensorboard/compat/proto: event.proto,
// summary.proto, tensor.proto, tensor_shape.proto, types.proto), which its readers decode by
// number: they never change.
namespace event {  // tensorboard.Event
constexpr int kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
}
namespace session_log {  // tensorboard.SessionLog
constexpr int kStatus = 1;
constexpr uint64_t kStart = 1;
}  // namespace session_log
namespace summary {  // tensorboard.Summary and Summary.Value
constexpr int kValue = 1;
constexpr int kTag = 1, kSimpleValue = 2, kTensor = 8, kMetadata = 9;
}  // namespace summary
namespace metadata {  // tensorboard.SummaryMetadata and its PluginData
constexpr int kPluginData = 1, kDataClass = 4;
constexpr int kPluginName = 1;
constexpr uint64_t kDataClassTensor = 2;
}  // namespace metadata
namespace tensor {  // tensorboard.TensorProto
constexpr int kDtype = 1, kTensorShape = 2, kStringVal = 8;
constexpr uint64_t kDtString = 7;
}  // namespace tensor

Message event_at(double wall_time, int64_t step) {
  Message e;
  e.float64(event::kWallTime, wall_time);
  if (step != 0) e.varint(event::kStep, static_cast<uint64_t>(step));  // int64: two's complement
  return e;
}

double wall_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
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

namespace tensorboard_events {

std::string file_version(double wall_time, int64_t step) {
  return event_at(wall_time, step).bytes(event::kFileVersion, "brain.Event:2").str();
}

std::string session_start(double wall_time, int64_t step) {
  return event_at(wall_time, step)
      .message(event::kSessionLog, Message().varint(session_log::kStatus, session_log::kStart))
      .str();
}

std::string scalars(double wall_time, int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  Message s;
  for (const auto& [tag, value] : values)
    s.message(summary::kValue, Message().bytes(summary::kTag, tag).float32(summary::kSimpleValue, value));
  return event_at(wall_time, step).message(event::kSummary, s).str();
}

// The text plugin's form: a rank-0 string tensor (its shape present and empty) whose metadata
// names the "text" plugin.
std::string text(double wall_time, int64_t step, const std::string& tag, const std::string& markdown) {
  Message t;
  t.varint(tensor::kDtype, tensor::kDtString)
      .message(tensor::kTensorShape, Message())
      .bytes(tensor::kStringVal, markdown);
  Message meta;
  meta.message(metadata::kPluginData, Message().bytes(metadata::kPluginName, "text"))
      .varint(metadata::kDataClass, metadata::kDataClassTensor);
  Message value;
  value.bytes(summary::kTag, tag).message(summary::kTensor, t).message(summary::kMetadata, meta);
  return event_at(wall_time, step).message(event::kSummary, Message().message(summary::kValue, value)).str();
}

}  // namespace tensorboard_events

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
  write_record(tensorboard_events::file_version(wall_time(), first_step));
  write_record(tensorboard_events::session_start(wall_time(), first_step));
}

void TensorBoardWriter::step(const StepReport& r, int rank) {
  if (!is_open()) return;
  const RankStep& mine = r.ranks.at(rank);
  std::vector<std::pair<std::string, float>> values;
  const auto add = [&values](const char* tag, double value) { values.emplace_back(tag, static_cast<float>(value)); };
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
  write_record(tensorboard_events::scalars(wall_time(), r.step, values));
}

void TensorBoardWriter::eval_loss(int64_t step, double loss) { scalar(kEvalLossTag, step, loss); }

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value) {
  if (!is_open()) return;
  write_record(tensorboard_events::scalars(wall_time(), step, {{tag, static_cast<float>(value)}}));
}

void TensorBoardWriter::text(const std::string& tag, int64_t step, const std::string& markdown) {
  if (!is_open()) return;
  write_record(tensorboard_events::text(wall_time(), step, tag, markdown));
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
