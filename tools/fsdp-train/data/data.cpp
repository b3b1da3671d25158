// data.cpp — synthetic and token-file data for fsdp-train, and the token file format.
#include "data/data.h"

#include "config/config.h"
#include "config/read_file.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string_view>

namespace fsdp {
namespace train {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'T', 'O', 'K', '\0'};
constexpr size_t kHeaderBytes = 32;
constexpr uint32_t kLlmcMagic = 20240520;
constexpr size_t kLlmcHeaderBytes = 256 * 4;

template <class T>
void put(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}

template <class T>
T get(const unsigned char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return static_cast<T>(v);
}

at::Generator seeded(int64_t seed) { return at::detail::createCPUGenerator(static_cast<uint64_t>(seed)); }

class SyntheticData : public DataSource {
 public:
  SyntheticData(int64_t vocab, int64_t seed) : vocab_(vocab), seed_(seed) {}
  at::Tensor global_batch(int64_t step, int64_t rows, int64_t seq) const override {
    return at::randint(0, vocab_, {rows, seq + 1}, seeded(seed_ + step), at::TensorOptions().dtype(at::kLong));
  }
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override {
    return "synthetic tokens (vocab " + std::to_string(vocab_) + ", data_seed " + std::to_string(seed_) + ")";
  }

 private:
  int64_t vocab_, seed_;
};

class TokenFileData : public DataSource {
 public:
  TokenFileData(std::string path, int64_t seed) : path_(std::move(path)), seed_(seed) {
    auto [header, tokens] = read_token_file(path_, "data.path");
    header_ = header;
    tokens_ = tokens;
  }
  at::Tensor global_batch(int64_t step, int64_t rows, int64_t seq) const override {
    const int64_t n = tokens_.numel();
    if (n < seq + 1) {
      throw std::runtime_error(path_ + ": " + std::to_string(n) + " tokens, fewer than one row of seq_len + 1 = " +
                               std::to_string(seq + 1) + "; use a longer text or a smaller training.seq_len");
    }
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor starts = at::randint(0, n - seq, {rows, 1}, seeded(seed_ + step), i64);
    return tokens_.index_select(0, (starts + at::arange(seq + 1, i64)).reshape({-1})).reshape({rows, seq + 1});
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(header_.vocab_size); }
  bool byte_level() const override { return header_.format == TokenFileFormat::kFsdp && header_.vocab_size <= 256; }
  std::string describe() const override {
    const bool llmc = header_.format == TokenFileFormat::kLlmc;
    return std::string(llmc ? "llm.c token file " : "token file ") + path_ + " (" + std::to_string(header_.num_tokens) +
           " tokens, " + (llmc ? "largest id + 1 " : "vocab ") + std::to_string(header_.vocab_size) + ", data_seed " +
           std::to_string(seed_) + ")";
  }
  const at::Tensor& tokens() const { return tokens_; }
  const TokenFileHeader& header() const { return header_; }

 private:
  std::string path_;
  int64_t seed_;
  TokenFileHeader header_;
  at::Tensor tokens_;
};

}  // namespace

void write_token_file(const std::string& path, const std::vector<uint32_t>& ids, uint64_t vocab_size) {
  const uint32_t token_bytes = vocab_size <= 65536 ? 2 : 4;
  std::string out(kMagic, kMagic + 8);
  put<uint32_t>(out, 1);
  put<uint32_t>(out, token_bytes);
  put<uint64_t>(out, vocab_size);
  put<uint64_t>(out, ids.size());
  out.reserve(out.size() + ids.size() * token_bytes);
  for (uint32_t id : ids) {
    if (id >= vocab_size) throw std::runtime_error("write_token_file: id " + std::to_string(id) + " >= vocab_size");
    if (token_bytes == 2) put<uint16_t>(out, static_cast<uint16_t>(id));
    else put<uint32_t>(out, id);
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) throw std::runtime_error(path + ": cannot write the token file");
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    if (!f) throw std::runtime_error(path + ": writing the token file failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) throw std::runtime_error(path + ": cannot rename " + tmp);
}

namespace {

// The whole file; throws naming it when it is missing, a directory or unreadable.
std::string token_file_bytes(const std::string& path, const std::string& key) {
  return read_file(path, {path + ": is a directory, not a token file (" + key + ")",
                          path + ": cannot open the token file (" + key + ")",
                          path + ": reading the token file failed (" + key + ")"});
}

bool is_llmc(std::string_view head) {
  return head.size() >= 4 && get<uint32_t>(reinterpret_cast<const unsigned char*>(head.data())) == kLlmcMagic;
}

// llm.c's header (from `head`, the file's first bytes): version 1, and a token count that matches
// the file's size. The vocabulary is left 0: the file records none.
TokenFileHeader checked_llmc_header(const std::string& path, std::string_view head, uint64_t file_size) {
  const auto* p = reinterpret_cast<const unsigned char*>(head.data());
  if (file_size < kLlmcHeaderBytes || head.size() < kLlmcHeaderBytes)
    throw std::runtime_error(path + ": an llm.c token file (magic 20240520) cut short: its header needs " +
                             std::to_string(kLlmcHeaderBytes) + " bytes, the file has " + std::to_string(file_size));
  TokenFileHeader h;
  h.format = TokenFileFormat::kLlmc;
  h.version = get<uint32_t>(p + 4);
  h.token_bytes = 2;
  h.num_tokens = get<uint32_t>(p + 8);
  if (h.version != 1)
    throw std::runtime_error(path + ": llm.c token file version " + std::to_string(h.version) +
                             " (this build reads version 1: uint16 ids)");
  const uint64_t payload = file_size - kLlmcHeaderBytes;
  if (h.num_tokens * 2 != payload)
    throw std::runtime_error(path + ": the llm.c header's token count (int32 2) is " + std::to_string(h.num_tokens) +
                             " uint16 tokens but the file has " + std::to_string(payload) +
                             " bytes of tokens (truncated or damaged?)");
  return h;
}

std::pair<TokenFileHeader, at::Tensor> read_llmc(const std::string& path, const std::string& bytes) {
  TokenFileHeader h = checked_llmc_header(path, bytes, bytes.size());
  at::Tensor ids = at::empty({static_cast<int64_t>(h.num_tokens)}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = ids.data_ptr<int64_t>();
  const unsigned char* q = reinterpret_cast<const unsigned char*>(bytes.data()) + kLlmcHeaderBytes;
  uint64_t largest = 0;
  for (uint64_t i = 0; i < h.num_tokens; ++i, q += 2) {
    const uint64_t id = get<uint16_t>(q);
    largest = std::max(largest, id);
    out[i] = static_cast<int64_t>(id);
  }
  h.vocab_size = largest + 1;
  return {h, ids};
}

// The header's fields (from `head`, the file's first bytes), checked against each other and the
// file's size without overflowing (a damaged header can hold any 64-bit value).
TokenFileHeader checked_header(const std::string& path, std::string_view head, uint64_t file_size) {
  const auto* p = reinterpret_cast<const unsigned char*>(head.data());
  if (head.size() < 8 || std::memcmp(p, kMagic, 8) != 0)
    throw std::runtime_error(path +
                             ": not a token file (neither an FSDPTOK header nor llm.c's magic 20240520); make one "
                             "with `fsdp-train tokenize` or tools/pretokenize.py");
  // The magic is there: a token file whose header was cut short (a copy that stopped early).
  if (head.size() < kHeaderBytes)
    throw std::runtime_error(path + ": the token file is truncated: its header needs " + std::to_string(kHeaderBytes) +
                             " bytes, the file has " + std::to_string(file_size) +
                             "; copy it again or remake it with `fsdp-train tokenize`");
  TokenFileHeader h;
  h.version = get<uint32_t>(p + 8);
  h.token_bytes = get<uint32_t>(p + 12);
  h.vocab_size = get<uint64_t>(p + 16);
  h.num_tokens = get<uint64_t>(p + 24);
  if (h.version != 1)
    throw std::runtime_error(path + ": token file version " + std::to_string(h.version) + " (this build reads 1)");
  if (h.token_bytes != 2 && h.token_bytes != 4)
    throw std::runtime_error(path + ": " + std::to_string(h.token_bytes) + " bytes per token (expected 2 or 4)");
  const uint64_t max_vocab = uint64_t{1} << (8 * h.token_bytes);  // ids are token_bytes wide
  if (h.vocab_size == 0 || h.vocab_size > max_vocab)
    throw std::runtime_error(path + ": the header's vocabulary size (offset 16) is " + std::to_string(h.vocab_size) +
                             "; expected 1 to " + std::to_string(max_vocab) + " for " + std::to_string(h.token_bytes) +
                             "-byte ids (a damaged header?)");
  const uint64_t payload = file_size - kHeaderBytes;
  if (h.num_tokens > payload / h.token_bytes || h.num_tokens * h.token_bytes != payload)
    throw std::runtime_error(path + ": the header's token count (offset 24) is " + std::to_string(h.num_tokens) +
                             " tokens of " + std::to_string(h.token_bytes) + " bytes but the file has " +
                             std::to_string(payload) + " bytes of tokens (truncated or damaged?)");
  return h;
}

// The first `n` bytes of the file (fewer when it is shorter) and its size, with the messages
// token_file_bytes gives.
std::pair<std::string, uint64_t> token_file_head(const std::string& path, const std::string& key, size_t n) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(path + ": is a directory, not a token file (" + key + ")");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(path + ": cannot open the token file (" + key + ")");
  std::string head(n, '\0');
  f.read(&head[0], static_cast<std::streamsize>(n));
  if (f.bad()) throw std::runtime_error(path + ": reading the token file failed (" + key + ")");
  head.resize(static_cast<size_t>(f.gcount()));
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) throw std::runtime_error(path + ": reading the token file failed (" + key + "): " + ec.message());
  return {head, size};
}

}  // namespace

std::pair<TokenFileHeader, at::Tensor> read_token_file(const std::string& path, const std::string& key) {
  const std::string bytes = token_file_bytes(path, key);
  if (is_llmc(bytes)) return read_llmc(path, bytes);
  const TokenFileHeader h = checked_header(path, bytes, bytes.size());
  at::Tensor ids = at::empty({static_cast<int64_t>(h.num_tokens)}, at::TensorOptions().dtype(at::kLong));
  int64_t* out = ids.data_ptr<int64_t>();
  const unsigned char* q = reinterpret_cast<const unsigned char*>(bytes.data()) + kHeaderBytes;
  for (uint64_t i = 0; i < h.num_tokens; ++i, q += h.token_bytes) {
    const uint64_t id = h.token_bytes == 2 ? get<uint16_t>(q) : get<uint32_t>(q);
    if (id >= h.vocab_size)
      throw std::runtime_error(path + ": token " + std::to_string(i) + " is " + std::to_string(id) +
                               ", not below the vocabulary size " + std::to_string(h.vocab_size));
    out[i] = static_cast<int64_t>(id);
  }
  return {h, ids};
}

TokenFileHeader read_token_file_header(const std::string& path, const std::string& key) {
  const auto [head, size] = token_file_head(path, key, std::max(kHeaderBytes, kLlmcHeaderBytes));
  return is_llmc(head) ? checked_llmc_header(path, head, size) : checked_header(path, head, size);
}

void check_ids_below(const std::string& path, const at::Tensor& ids, int64_t vocab_size) {
  if (ids.numel() == 0) return;
  const at::Tensor beyond = (ids >= vocab_size).nonzero();
  if (beyond.numel() == 0) return;
  const int64_t at_pos = beyond[0][0].item<int64_t>();
  throw ConfigError(path + ": token " + std::to_string(at_pos) + " is id " +
                    std::to_string(ids[at_pos].item<int64_t>()) + ", not below model.vocab_size (" +
                    std::to_string(vocab_size) +
                    "): a model cannot embed it; raise model.vocab_size or tokenize with the model's tokenizer");
}

at::Tensor eval_batch(const at::Tensor& tokens, int64_t b, int64_t rows, int64_t seq) {
  return tokens.narrow(0, b * rows * (seq + 1), rows * (seq + 1)).view({rows, seq + 1});
}

std::unique_ptr<DataSource> synthetic_data(int64_t vocab_size, int64_t data_seed) {
  return std::make_unique<SyntheticData>(vocab_size, data_seed);
}

std::unique_ptr<DataSource> token_file_data(const std::string& path, int64_t data_seed, int64_t model_vocab) {
  auto d = std::make_unique<TokenFileData>(path, data_seed);
  // The first id the model cannot embed, named; then a recorded vocabulary larger than the
  // model's, even when this file's ids happen to fit (its tokenizer can make ones that do not).
  check_ids_below(path, d->tokens(), model_vocab);
  if (d->header().format == TokenFileFormat::kFsdp && d->vocab_size() > model_vocab)
    throw ConfigError("data.path " + path + " has a vocabulary of " + std::to_string(d->vocab_size()) +
                      " but model.vocab_size is " + std::to_string(model_vocab) + "; raise model.vocab_size");
  return d;
}

std::pair<at::Tensor, at::Tensor> micro_batch(const at::Tensor& global_batch, int rank, int64_t accumulation,
                                              int64_t micro, int64_t batch) {
  at::Tensor rows = global_batch.narrow(0, (rank * accumulation + micro) * batch, batch);
  const int64_t seq = global_batch.size(1) - 1;
  return {rows.narrow(1, 0, seq).contiguous(), rows.narrow(1, 1, seq).contiguous()};
}

}  // namespace train
}  // namespace fsdp
