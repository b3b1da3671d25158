// tokenizer.h — text to token ids and back: the byte-level tokenizer (every byte one token,
// vocabulary 256) and SentencePiece models (the tokenizers of many Hugging Face models), read
// through Debian's libsentencepiece. `fsdp-train tokenize` encodes a text with one, and the
// sample after a run decodes with the same one (data.tokenizer). Byte-level BPE tokenizers
// (tokenizer.json) are Python's `tokenizers` package's: tools/pretokenize.py
// writes the same token files. No torch here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids of `text`, each below vocab_size().
  virtual std::vector<uint32_t> encode(const std::string& text) const = 0;
  // The text of `ids`. An id the tokenizer does not have (a model's vocabulary can be larger
  // than its tokenizer's) is written as "<id N>" rather than dropped.
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual uint64_t vocab_size() const = 0;
  // "byte-level (vocabulary 256)" or "SentencePiece model <path> (vocabulary N)".
  virtual std::string describe() const = 0;
};

std::unique_ptr<Tokenizer> byte_tokenizer();

// Loads the SentencePiece model at `path`. Throws std::runtime_error naming the file and `key`
// (where the path came from: "--tokenizer", "data.tokenizer") when it is missing, a directory,
// unreadable, or not a SentencePiece model.
std::unique_ptr<Tokenizer> sentencepiece_tokenizer(const std::string& path, const std::string& key);

}  // namespace train
}  // namespace fsdp
