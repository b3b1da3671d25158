// Units of fsdp-train's token files (data.h): the project's own format, llm.c's .bin files, ids
// beyond a model's vocabulary, and the evaluation windows. Files are written by hand here, byte
// by byte, so that the readers are checked against the formats, not against their own writer.
#include "config/config.h"
#include "data/data.h"
#include "error_of.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace fsdp::train;

class ScratchDir {
 public:
  ScratchDir() {
    path_ = std::filesystem::temp_directory_path() / ("fsdp_data_test_" + std::to_string(::getpid()) + "_" +
                                                      ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

void put32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// llm.c's layout: 256 int32 (magic, version, count, zeros), then uint16 ids.
std::string llmc_bytes(const std::vector<uint16_t>& ids, uint32_t version = 1, int64_t count = -1) {
  std::string out;
  put32(out, 20240520);
  put32(out, version);
  put32(out, static_cast<uint32_t>(count < 0 ? ids.size() : count));
  out.resize(256 * 4, '\0');
  for (uint16_t id : ids) {
    out.push_back(static_cast<char>(id & 0xff));
    out.push_back(static_cast<char>(id >> 8));
  }
  return out;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<int64_t> values(const at::Tensor& t) {
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

using fsdp_test::error_of;

TEST(TokenFiles, OwnFormatRoundTripsWithItsVocabulary) {
  ScratchDir dir;
  write_token_file(dir / "a.tokens", {0, 5, 999, 3}, 1000);
  const auto [h, ids] = read_token_file(dir / "a.tokens");
  EXPECT_EQ(h.format, TokenFileFormat::kFsdp);
  EXPECT_EQ(h.vocab_size, 1000u);
  EXPECT_EQ(h.token_bytes, 2u);
  EXPECT_EQ(values(ids), (std::vector<int64_t>{0, 5, 999, 3}));
  write_token_file(dir / "b.tokens", {70000, 1}, 100000);  // past uint16: 4-byte ids
  const auto [h4, ids4] = read_token_file(dir / "b.tokens");
  EXPECT_EQ(h4.token_bytes, 4u);
  EXPECT_EQ(values(ids4), (std::vector<int64_t>{70000, 1}));
}

TEST(TokenFiles, ReadsLlmcBinFilesByTheirMagic) {
  ScratchDir dir;
  write_bytes(dir / "train.bin", llmc_bytes({50256, 0, 17, 65535}));
  const auto [h, ids] = read_token_file(dir / "train.bin");
  EXPECT_EQ(h.format, TokenFileFormat::kLlmc);
  EXPECT_EQ(h.num_tokens, 4u);
  EXPECT_EQ(h.vocab_size, 65536u);  // the largest id + 1: llm.c records no vocabulary
  EXPECT_EQ(values(ids), (std::vector<int64_t>{50256, 0, 17, 65535}));
}

TEST(TokenFiles, LlmcFileWithAnotherVersionOrAWrongCountIsRefusedNamingTheFile) {
  ScratchDir dir;
  write_bytes(dir / "v2.bin", llmc_bytes({1, 2}, /*version=*/2));
  std::string e = error_of([&] { read_token_file(dir / "v2.bin"); });
  EXPECT_NE(e.find(dir / "v2.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("version 2"), std::string::npos) << e;
  write_bytes(dir / "short.bin", llmc_bytes({1, 2, 3}, 1, /*count=*/5));
  e = error_of([&] { read_token_file(dir / "short.bin"); });
  EXPECT_NE(e.find(dir / "short.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("token count"), std::string::npos) << e;
  write_bytes(dir / "cut.bin", llmc_bytes({}).substr(0, 100));
  e = error_of([&] { read_token_file(dir / "cut.bin"); });
  EXPECT_NE(e.find("cut short"), std::string::npos) << e;
}

// `fsdp-train plan` reads the header alone, with the trainer's checks: the same files pass, with
// the same token count, and the same files fail, with the same message.
TEST(TokenFiles, TheHeaderAloneIsCheckedAsTheWholeFileIs) {
  ScratchDir dir;
  write_token_file(dir / "own.tokens", {0, 5, 999, 3}, 1000);
  write_token_file(dir / "wide.tokens", {70000, 1}, 100000);
  write_bytes(dir / "train.bin", llmc_bytes({50256, 0, 17, 65535, 4}));
  write_bytes(dir / "v2.bin", llmc_bytes({1, 2}, /*version=*/2));
  write_bytes(dir / "short.bin", llmc_bytes({1, 2, 3}, 1, /*count=*/5));
  write_bytes(dir / "cut.bin", llmc_bytes({}).substr(0, 100));
  write_bytes(dir / "text.txt", "plain text, not tokens\n");
  std::string own = "FSDPTOK";
  own.push_back('\0');
  write_bytes(dir / "cut.tokens", own + "\x01\x00\x00\x00\x02\x00");
  std::string long_count;
  {
    std::ifstream in(dir / "own.tokens", std::ios::binary);
    long_count.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    long_count[24] = 9;  // 9 tokens claimed, 4 present
  }
  write_bytes(dir / "long_count.tokens", long_count);
  std::filesystem::create_directories(dir / "a_directory");
  for (const std::string name : {"own.tokens", "wide.tokens", "train.bin", "v2.bin", "short.bin", "cut.bin", "text.txt",
                                 "cut.tokens", "long_count.tokens", "a_directory", "missing.bin"}) {
    SCOPED_TRACE(name);
    const std::string path = dir / name;
    const std::string whole = error_of([&] { read_token_file(path, "eval.path"); });
    const std::string header = error_of([&] { read_token_file_header(path, "eval.path"); });
    EXPECT_EQ(header, whole);
    if (!whole.empty()) continue;
    EXPECT_EQ(read_token_file_header(path).num_tokens, read_token_file(path).first.num_tokens);
    EXPECT_EQ(read_token_file_header(path).format, read_token_file(path).first.format);
  }
}

TEST(TokenFiles, NeitherFormatIsRefusedSayingHowToMakeOne) {
  ScratchDir dir;
  write_bytes(dir / "text.txt", "plain text, not tokens\n");
  const std::string e = error_of([&] { read_token_file(dir / "text.txt", "eval.path"); });
  EXPECT_NE(e.find(dir / "text.txt"), std::string::npos) << e;
  EXPECT_NE(e.find("fsdp-train tokenize"), std::string::npos) << e;
  const std::string missing = error_of([&] { read_token_file(dir / "none.tokens", "eval.path"); });
  EXPECT_NE(missing.find("eval.path"), std::string::npos) << missing;
}

TEST(TokenFiles, AnIdBeyondTheModelsVocabularyIsNamedWithItsFileAndPosition) {
  ScratchDir dir;
  write_bytes(dir / "big.bin", llmc_bytes({1, 2, 3, 300, 4, 500}));
  const std::string e = error_of([&] { token_file_data(dir / "big.bin", 0, /*model_vocab=*/256); });
  EXPECT_NE(e.find(dir / "big.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("token 3 is id 300"), std::string::npos) << e;
  EXPECT_NE(e.find("model.vocab_size (256)"), std::string::npos) << e;
  EXPECT_THROW(token_file_data(dir / "big.bin", 0, 256), ConfigError);
  EXPECT_NO_THROW(token_file_data(dir / "big.bin", 0, 501));
  // The own format records its vocabulary: one above the model's is refused even when the ids
  // fit, and an id that does not fit is named.
  write_token_file(dir / "v.tokens", {1, 2}, 1000);
  const std::string own = error_of([&] { token_file_data(dir / "v.tokens", 0, 256); });
  EXPECT_NE(own.find("vocabulary of 1000"), std::string::npos) << own;
  write_token_file(dir / "w.tokens", {1, 2, 700}, 1000);
  const std::string id = error_of([&] { token_file_data(dir / "w.tokens", 0, 256); });
  EXPECT_NE(id.find(dir / "w.tokens" + ": token 2 is id 700"), std::string::npos) << id;
}

TEST(TokenFiles, OwnFormatWithAnIdAtOrAboveItsVocabularyIsRefused) {
  ScratchDir dir;
  std::string bytes = "FSDPTOK";
  bytes.push_back('\0');
  put32(bytes, 1);
  put32(bytes, 2);
  put32(bytes, 10), put32(bytes, 0);  // vocabulary 10
  put32(bytes, 2), put32(bytes, 0);   // two tokens
  bytes += std::string("\x03\x00\x0a\x00", 4);
  write_bytes(dir / "bad.tokens", bytes);
  const std::string e = error_of([&] { read_token_file(dir / "bad.tokens"); });
  EXPECT_NE(e.find("token 1 is 10"), std::string::npos) << e;
}

TEST(TokenFiles, EvalBatchesAreConsecutiveWindowsFromTheStart) {
  const at::Tensor tokens = at::arange(100, at::kLong);
  const at::Tensor b0 = eval_batch(tokens, 0, /*rows=*/2, /*seq=*/4);
  const at::Tensor b1 = eval_batch(tokens, 1, 2, 4);
  EXPECT_EQ(values(b0.contiguous()), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(values(b1.contiguous()), (std::vector<int64_t>{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}));
  // Rank 1 of two, one row each: the second window, as one rank of two rows sees it.
  auto [inputs, targets] = micro_batch(b0, /*rank=*/1, 1, 0, /*batch=*/1);
  EXPECT_EQ(values(inputs), (std::vector<int64_t>{5, 6, 7, 8}));
  EXPECT_EQ(values(targets), (std::vector<int64_t>{6, 7, 8, 9}));
}

}  // namespace
