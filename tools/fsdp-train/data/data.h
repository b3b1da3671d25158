// data.h — where fsdp-train's tokens come from, and the token file format.
//
// Every optimizer step s (counted from 0: the run's first step is s = 0) has one global batch
// of world * accumulation * B rows of seq + 1 tokens, drawn from a generator seeded with
// data_seed + s; rank r's micro-batch m is rows [(r * accumulation + m) * B, + B). So the data
// depends only on the step and the global batch, not on how it is split over ranks and
// micro-batches: a run restarted at step s sees exactly what it would have seen, and
// W=2 x B=4 sees the rows of W=1 x B=8. The synthetic rows are those of Python's
// torch.randint(0, vocab, (rows, seq + 1), generator=g) with g a torch.Generator seeded
// data_seed + s, so a PyTorch program can train on the same data.
//
// Token file (little-endian), written by `fsdp-train tokenize`:
//   offset  0  8 bytes   magic "FSDPTOK\0"
//   offset  8  uint32    format version (1)
//   offset 12  uint32    bytes per token: 2 (uint16 ids) or 4 (uint32 ids)
//   offset 16  uint64    vocabulary size (every id is below it)
//   offset 24  uint64    number of tokens N
//   offset 32  N ids
// llm.c's token files (.bin, the format C trainers share) are read too, told apart by their
// first int32: a header of 256 little-endian int32 (magic 20240520, version 1, the token count
// N, the rest unused), then N uint16 ids. They record no vocabulary size: the model's
// vocabulary is checked against the ids themselves.
// A row is seq + 1 consecutive tokens starting at a position drawn uniformly from [0, N - seq).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace train {

enum class TokenFileFormat { kFsdp, kLlmc };

struct TokenFileHeader {
  TokenFileFormat format = TokenFileFormat::kFsdp;
  uint32_t version = 1;
  uint32_t token_bytes = 2;
  uint64_t vocab_size = 0;  // llm.c: the largest id + 1 (the file records none)
  uint64_t num_tokens = 0;
};

// Writes ids (each < vocab_size) as a token file, choosing 2-byte ids when vocab_size <= 65536.
void write_token_file(const std::string& path, const std::vector<uint32_t>& ids, uint64_t vocab_size);
// Reads a token file whole, in either format (told apart by its magic): the header and the ids
// as an int64 tensor [N]. Throws std::runtime_error naming the file and what is wrong (a
// directory, magic, version, a vocabulary size outside 1..2^(8 * bytes per token), a token
// count that does not match the file's size, an id >= vocab); header values are checked
// without overflowing. `key` is the configuration key the path came from (data.path,
// eval.path), for the messages.
std::pair<TokenFileHeader, at::Tensor> read_token_file(const std::string& path, const std::string& key = "data.path");

// The header of a token file in either format, checked as read_token_file checks it (the token
// count against the file's size included) but without reading the ids: what `fsdp-train plan`
// needs. An llm.c file's vocab_size is 0 here (the file records none; read_token_file takes the
// largest id + 1). Throws what read_token_file throws for a header.
TokenFileHeader read_token_file_header(const std::string& path, const std::string& key = "data.path");

// Throws ConfigError naming `path`, the first token at or above `vocab_size`, its position and
// model.vocab_size: a model cannot embed an id beyond its vocabulary.
void check_ids_below(const std::string& path, const at::Tensor& ids, int64_t vocab_size);

// The rows of training data of one optimizer step.
class DataSource {
 public:
  virtual ~DataSource() = default;
  // The global batch of step `step` (counted from 0): int64 [rows, seq + 1], identical on every
  // rank.
  virtual at::Tensor global_batch(int64_t step, int64_t rows, int64_t seq) const = 0;
  // Every token id is below this.
  virtual int64_t vocab_size() const = 0;
  // Whether the ids are bytes (a token file of `fsdp-train tokenize` without --tokenizer), so
  // that a sample can be printed as text without a tokenizer.
  virtual bool byte_level() const { return false; }
  virtual std::string describe() const = 0;
};

// Uniform random ids in [0, vocab), as torch.randint with a torch.Generator seeded
// data_seed + step.
std::unique_ptr<DataSource> synthetic_data(int64_t vocab_size, int64_t data_seed);
// Windows of a token file (data.path, either format) at positions drawn with a generator seeded
// data_seed + step. Throws ConfigError when its ids do not fit a model of `model_vocab` (an id
// at or above it, named; a recorded vocabulary above it, for files that record one), and
// std::runtime_error when the file is shorter than seq + 1 tokens (checked at the first batch).
std::unique_ptr<DataSource> token_file_data(const std::string& path, int64_t data_seed, int64_t model_vocab);

// The evaluation batches of a token file: global batch b (from 0) of `rows` rows is the
// consecutive, non-overlapping windows b * rows ... (b + 1) * rows - 1, window i being tokens
// [i * (seq + 1), (i + 1) * (seq + 1)): the first tokens of the file, in order, the same at
// any world size. int64 [rows, seq + 1]; `tokens` must hold them (the caller checks).
at::Tensor eval_batch(const at::Tensor& tokens, int64_t b, int64_t rows, int64_t seq);

// Rank `rank`'s micro-batch `micro` of a global batch (see above): (inputs, targets), each
// int64 [B, seq].
std::pair<at::Tensor, at::Tensor> micro_batch(const at::Tensor& global_batch, int rank, int64_t accumulation,
                                              int64_t micro, int64_t batch);

}  // namespace train
}  // namespace fsdp
