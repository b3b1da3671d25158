// Units of fsdp-train's tokenizers (tokenizer.h): the byte-level one, and SentencePiece models
// trained here by Debian's spm_train on a small text (skipped, saying why, without spm_train or in
// a build without SentencePiece, where the refusal is tested instead).
#include "config/config.h"
#include "data/tokenizer.h"
#include "error_of.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace {

using namespace fsdp::train;

using fsdp_test::error_of;

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_tokenizer_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

// A SentencePiece model of `vocab` pieces trained on the GPL-3 text, once per test program;
// "" when spm_train is not installed.
const std::string& trained_model() {
  static const std::string model = [] {
    if (std::system("command -v spm_train >/dev/null 2>&1") != 0) return std::string();
    const std::string prefix = scratch("gpl3");
    const std::string cmd = "spm_train --input=/usr/share/common-licenses/GPL-3 --model_prefix=" + prefix +
                            " --vocab_size=300 --model_type=unigram --num_threads=1 --minloglevel=2 "
                            ">/dev/null 2>&1";
    return std::system(cmd.c_str()) == 0 ? prefix + ".model" : std::string();
  }();
  return model;
}

#define SKIP_WITHOUT_SPM_TRAIN()                                                                        \
  do {                                                                                                  \
    if (!built_with_sentencepiece())                                                                    \
      GTEST_SKIP() << "this build has no SentencePiece (FSDP_WITH_SENTENCEPIECE=OFF, or AUTO without "  \
                      "libsentencepiece-dev)";                                                          \
    if (trained_model().empty())                                                                        \
      GTEST_SKIP() << "spm_train (Debian's sentencepiece package, scripts/install-deps.sh) is missing " \
                      "or failed, so no SentencePiece model could be trained";                          \
  } while (0)

TEST(Tokenizer, ByteLevelRoundTripsAnyBytesAndNamesIdsItDoesNotHave) {
  const auto t = byte_tokenizer();
  const std::string text("caf\xc3\xa9\n\0x", 8);
  const auto ids = t->encode(text);
  ASSERT_EQ(ids.size(), 8u);
  EXPECT_EQ(t->decode(std::vector<int64_t>(ids.begin(), ids.end())), text);
  EXPECT_EQ(t->decode({104, 105, 300}), "hi<id 300>");
  EXPECT_EQ(t->vocab_size(), 256u);
}

TEST(Tokenizer, SentencePieceModelRoundTripsTextWithItsVocabularySize) {
  SKIP_WITHOUT_SPM_TRAIN();
  const auto t = sentencepiece_tokenizer(trained_model(), "--tokenizer");
  EXPECT_EQ(t->vocab_size(), 300u);
  const std::string text = "This program is free software: you can redistribute it.";
  const auto ids = t->encode(text);
  EXPECT_LT(ids.size(), text.size());  // pieces, not bytes
  for (uint32_t id : ids) EXPECT_LT(id, 300u);
  EXPECT_EQ(t->decode(std::vector<int64_t>(ids.begin(), ids.end())), text);
  EXPECT_NE(t->describe().find("SentencePiece model " + trained_model()), std::string::npos);
}

TEST(Tokenizer, SentencePieceDecodeNamesIdsBeyondItsVocabulary) {
  SKIP_WITHOUT_SPM_TRAIN();
  const auto t = sentencepiece_tokenizer(trained_model(), "data.tokenizer");
  const auto ids = t->encode("free software");
  std::vector<int64_t> with_unknown(ids.begin(), ids.end());
  with_unknown.push_back(300);
  EXPECT_EQ(t->decode(with_unknown), "free software<id 300>");
}

TEST(Tokenizer, AFileThatIsNotASentencePieceModelIsRefusedNamingTheFileAndKey) {
  if (!built_with_sentencepiece()) GTEST_SKIP() << "this build has no SentencePiece (FSDP_WITH_SENTENCEPIECE)";
  const std::string text = scratch("not_a_model.txt");
  std::ofstream(text) << "just some text\nthat is not a protobuf\n";
  std::string e = error_of([&] { sentencepiece_tokenizer(text, "data.tokenizer"); });
  EXPECT_NE(e.find(text + " (data.tokenizer): not a SentencePiece model"), std::string::npos) << e;
  const std::string empty = scratch("empty.model");
  std::ofstream(empty).flush();
  e = error_of([&] { sentencepiece_tokenizer(empty, "--tokenizer"); });
  EXPECT_NE(e.find(empty + " (--tokenizer): not a SentencePiece model"), std::string::npos) << e;
  e = error_of([&] { sentencepiece_tokenizer(scratch("missing.model"), "--tokenizer"); });
  EXPECT_NE(e.find("missing.model (--tokenizer): cannot open"), std::string::npos) << e;
}

// A build without SentencePiece refuses a model by its key and the build option, before the
// file is read; a build with it goes on to read the file.
TEST(Tokenizer, WhetherSentencePieceIsBuiltInDecidesTheRefusal) {
  const std::string missing = scratch("never_written.model");
  const std::string e = error_of([&] { sentencepiece_tokenizer(missing, "--tokenizer"); });
  if (built_with_sentencepiece()) {
    EXPECT_NE(e.find("never_written.model (--tokenizer): cannot open"), std::string::npos) << e;
  } else {
    EXPECT_NE(e.find("--tokenizer: " + missing + " needs SentencePiece"), std::string::npos) << e;
    EXPECT_NE(e.find("-DFSDP_WITH_SENTENCEPIECE=ON"), std::string::npos) << e;
  }
}

}  // namespace
