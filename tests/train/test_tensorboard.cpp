// test_tensorboard.cpp — the framing of fsdp-train's TensorBoard event files: CRC-32C against the
// standard test vectors (RFC 3720, B.4, and the common check value), the TFRecord mask and
// layout, and the writer's file read back record by record with every CRC checked. That
// TensorBoard itself reads the files is test_tensorboard.py's part.
#include "config/config.h"
#include "outputs/tensorboard.h"
#include "outputs/tfrecord.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

using namespace fsdp::train;

namespace {

std::string from_hex(const std::string& hex) {
  std::string s;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    s.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return s;
}

uint64_t read_le(const std::string& s, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(s[at + i])) << (8 * i);
  return v;
}

// The payloads of the TFRecords in `data`, checking each record's two CRCs on the way.
std::vector<std::string> read_records(const std::string& data) {
  std::vector<std::string> payloads;
  size_t at = 0;
  while (at < data.size()) {
    EXPECT_GE(data.size() - at, 16u) << "a truncated record at byte " << at;
    if (data.size() - at < 16) break;
    const uint64_t n = read_le(data, at, 8);
    EXPECT_EQ(read_le(data, at + 8, 4), masked_crc32c(data.substr(at, 8))) << "length CRC at byte " << at;
    EXPECT_LE(at + 12 + n + 4, data.size());
    const std::string payload = data.substr(at + 12, n);
    EXPECT_EQ(read_le(data, at + 12 + n, 4), masked_crc32c(payload)) << "payload CRC at byte " << at;
    payloads.push_back(payload);
    at += 12 + n + 4;
  }
  return payloads;
}

std::string read_whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::filesystem::path scratch(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("fsdp_tensorboard_test_" + std::to_string(getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace

// RFC 3720 (iSCSI), appendix B.4: the CRC-32C of four 32-byte patterns and of a read command
// PDU; and "123456789", the check value every CRC catalogue lists.
TEST(Crc32c, StandardTestVectors) {
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
  // The 48 bytes of the PDU, as the RFC lists them.
  const std::string read_pdu = from_hex(
      "01c00000000000000000000000000000"
      "14000000000004000000001400000018"
      "28000000000000000200000000000000");
  ASSERT_EQ(read_pdu.size(), 48u);
  EXPECT_EQ(crc32c(read_pdu), 0xD9963A56u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
}

TEST(Crc32c, ContinuesAcrossPieces) {
  const std::string text = "The GNU General Public License is a free, copyleft license";
  for (size_t cut : {size_t{0}, size_t{1}, size_t{17}, text.size()})
    EXPECT_EQ(crc32c(text.substr(cut), crc32c(text.substr(0, cut))), crc32c(text)) << "cut at " << cut;
}

// The mask: rotate right by 15 bits, add 0xA282EAD8 (mod 2^32).
TEST(Crc32c, MaskedAsTfRecordStoresIt) {
  EXPECT_EQ(masked_crc32c(""), 0xA282EAD8u);
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);  // 0xE3069283 rotated, plus the delta
}

TEST(TfRecord, FramesLengthCrcPayloadCrc) {
  const std::string payload = "an Event message";
  const std::string record = tfrecord_frame(payload);
  ASSERT_EQ(record.size(), 8 + 4 + payload.size() + 4);
  EXPECT_EQ(read_le(record, 0, 8), payload.size());
  EXPECT_EQ(read_le(record, 8, 4), masked_crc32c(record.substr(0, 8)));
  EXPECT_EQ(record.substr(12, payload.size()), payload);
  EXPECT_EQ(read_le(record, 12 + payload.size(), 4), masked_crc32c(payload));
  const std::string empty = tfrecord_frame("");
  ASSERT_EQ(empty.size(), 16u);
  EXPECT_EQ(read_le(empty, 12, 4), 0xA282EAD8u);
  // A payload of 300 bytes: the length's second byte is used.
  const std::string longer = tfrecord_frame(std::string(300, 'x'));
  EXPECT_EQ(read_le(longer, 0, 8), 300u);
  EXPECT_EQ(read_records(longer + record), (std::vector<std::string>{std::string(300, 'x'), payload}));
}

// Each event's bytes against what protoc's C++ code wrote for the same tensorboard.Event (from
// .proto files with TensorBoard's field numbers, protobuf 3.21): field order, proto3's omitted
// default step, oneof values written even at zero, the empty tensor shape and nested lengths.
TEST(TensorBoardEvents, SameBytesAsProtobuf) {
  const double t = 1700000000.25;
  EXPECT_EQ(tensorboard_events::file_version(t, 7), from_hex("0900001040fc54d94110071a0d627261696e2e4576656e743a32"));
  EXPECT_EQ(tensorboard_events::session_start(t, 300), from_hex("0900001040fc54d94110ac023a020801"));
  EXPECT_EQ(tensorboard_events::session_start(t, 0), from_hex("0900001040fc54d9413a020801"));
  EXPECT_EQ(tensorboard_events::scalars(t, 12, {{"train/loss", 2.5f}, {"train/lr", 0.0003f}}),
            from_hex("0900001040fc54d941100c2a240a110a0a747261696e2f6c6f737315000020400a0f0a08747261696e2f6c721552"
                     "499d39"));
  EXPECT_EQ(tensorboard_events::scalars(t, 12, {{"x", 0.0f}}),
            from_hex("0900001040fc54d941100c2a0a0a080a01781500000000"));
  EXPECT_EQ(tensorboard_events::text(t, 3, "config", "some *markdown*"),
            from_hex("0900001040fc54d94110032a2d0a2b0a06636f6e666967421508071200420f736f6d65202a6d61726b646f776e2a"
                     "4a0a0a060a04746578742002"));
}

// A text longer than 127 bytes takes a two-byte length (varint), inside three nested messages.
TEST(TensorBoardEvents, LongTextLengthsAreVarints) {
  const std::string markdown(300, 'm');
  const std::string bytes = tensorboard_events::text(1.0, 1, "config", markdown);
  // The string_val field: key 0x42, then 300 as a varint (0xac 0x02), then the text.
  EXPECT_NE(bytes.find(std::string("\x42\xac\x02") + markdown), std::string::npos);
  // wall_time 9, step 2; the summary, its value and the tensor each a key and a two-byte length;
  // the tag 8; dtype and shape 2 + 2; string_val 3 + 300; the metadata 12.
  EXPECT_EQ(bytes.size(), 9u + 2u + 3u * 3u + 8u + 4u + 303u + 12u);
}

// The writer's file: the version event, the session start, then one record per write, each
// with valid CRCs; the folder is made when missing.
TEST(TensorBoardWriter, WritesFramedEventsIntoANewFolder) {
  const auto dir = scratch("writes") / "nested" / "tb";
  TensorBoardWriter writer;
  EXPECT_FALSE(writer.is_open());
  writer.scalar("train/loss", 1, 2.5);  // not open: nothing, no error
  writer.open(dir.string(), 1);
  ASSERT_TRUE(writer.is_open());
  const std::string name = std::filesystem::path(writer.path()).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  StepReport r;
  r.step = 1;
  r.loss = 5.5;
  r.ranks.resize(1);
  writer.step(r, 0);
  writer.eval_loss(1, 5.25);
  writer.text(kConfigTag, 0, "some *markdown*");
  const std::vector<std::string> records = read_records(read_whole(writer.path()));
  ASSERT_EQ(records.size(), 5u);
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  EXPECT_NE(records[2].find("train/loss"), std::string::npos);
  EXPECT_NE(records[3].find(kEvalLossTag), std::string::npos);
  EXPECT_NE(records[4].find("some *markdown*"), std::string::npos);
  std::filesystem::remove_all(scratch("writes"));
}

TEST(TensorBoardWriter, UnwritableFolderNamesTheKey) {
  const auto dir = scratch("unwritable");
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "a_file") << "not a folder";
  TensorBoardWriter writer;
  try {
    writer.open((dir / "a_file" / "tb").string(), 1);
    FAIL() << "opened an event file under a regular file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("logging.tensorboard_dir"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("a_file"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// The Text tab's configuration: the file as given and the overrides in order.
TEST(TensorBoardConfigText, FileAndOverrides) {
  TrainConfig cfg;
  cfg.source.path = "configs/tiny.yaml";
  cfg.source.text = "training:\n  steps: 20\n";
  cfg.source.overrides = {"--training.steps=6", "--logging.tensorboard_dir=tb"};
  const std::string md = config_markdown(cfg);
  EXPECT_NE(md.find("`configs/tiny.yaml`"), std::string::npos) << md;
  EXPECT_NE(md.find("```yaml\ntraining:\n  steps: 20\n```"), std::string::npos) << md;
  EXPECT_LT(md.find("--training.steps=6"), md.find("--logging.tensorboard_dir=tb")) << md;
  EXPECT_NE(config_markdown(TrainConfig()).find("built-in defaults"), std::string::npos);
}
