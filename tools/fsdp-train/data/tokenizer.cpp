// tokenizer.cpp — the byte-level and SentencePiece tokenizers (tokenizer.h).
#include "data/tokenizer.h"

#include "config/config.h"
#include "config/read_file.h"

#if FSDP_WITH_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp {
namespace train {
namespace {

std::string unknown_id(int64_t id) { return "<id " + std::to_string(id) + ">"; }

class ByteTokenizer : public Tokenizer {
 public:
  std::vector<uint32_t> encode(const std::string& text) const override {
    std::vector<uint32_t> ids;
    ids.reserve(text.size());
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string s;
    for (int64_t id : ids) s += id >= 0 && id < 256 ? std::string(1, static_cast<char>(id)) : unknown_id(id);
    return s;
  }
  uint64_t vocab_size() const override { return 256; }
  std::string describe() const override { return "byte-level (vocabulary 256)"; }
};

#if FSDP_WITH_SENTENCEPIECE
// What the library said, without its source location: a file of another kind does not parse
// as its model protobuf; one that parses can still be refused (a broken vocabulary).
std::string why_not_a_model(const std::string& said) {
  if (said.empty()) return "it parses, but has no pieces";
  if (said.find("ParseFromArray") != std::string::npos) return "its bytes do not parse as a SentencePiece model";
  return said;
}

class SentencePieceTokenizer : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& path, const std::string& key) : path_(path) {
    const std::string where = path + " (" + key + ")";
    const std::string bytes = read_file(
        path, {where + ": is a directory, not a SentencePiece model", where + ": cannot open the SentencePiece model",
               where + ": reading the SentencePiece model failed"});
    const auto status = sp_.LoadFromSerializedProto(bytes);
    // An empty or foreign file can parse as an empty model; a real one has at least its
    // unknown, begin and end pieces.
    if (!status.ok() || sp_.GetPieceSize() <= 0) {
      throw std::runtime_error(where + ": not a SentencePiece model (" +
                               why_not_a_model(status.ok() ? std::string() : status.ToString()) +
                               "); give the .model file that spm_train writes, or for a tokenizer.json "
                               "use tools/pretokenize.py");
    }
    pieces_ = sp_.GetPieceSize();
  }

  std::vector<uint32_t> encode(const std::string& text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok())
      throw std::runtime_error(path_ + ": SentencePiece could not encode the text: " + status.ToString());
    return std::vector<uint32_t>(ids.begin(), ids.end());
  }
  // Runs of known ids are decoded together (a piece's leading space depends on its neighbours).
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    std::vector<int> run;
    const auto flush = [&] {
      std::string text;
      if (!run.empty() && sp_.Decode(run, &text).ok()) out += text;
      run.clear();
    };
    for (int64_t id : ids) {
      if (id >= 0 && id < pieces_) {
        run.push_back(static_cast<int>(id));
        continue;
      }
      flush();
      out += unknown_id(id);
    }
    flush();
    return out;
  }
  uint64_t vocab_size() const override { return static_cast<uint64_t>(pieces_); }
  std::string describe() const override {
    return "SentencePiece model " + path_ + " (vocabulary " + std::to_string(vocab_size()) + ")";
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  int pieces_ = 0;
};
#endif

}  // namespace

std::unique_ptr<Tokenizer> byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> sentencepiece_tokenizer(const std::string& path, const std::string& key) {
#if FSDP_WITH_SENTENCEPIECE
  return std::make_unique<SentencePieceTokenizer>(path, key);
#else
  throw std::runtime_error(without_sentencepiece(key, path));
#endif
}

}  // namespace train
}  // namespace fsdp
