// read_file.cpp — read_file of read_file.h.
#include "config/read_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

namespace fsdp {
namespace train {

std::string read_file(const std::string& path, const ReadFileErrors& errors, const ReadFileLimits& limits) {
  // An ifstream opens a directory without complaint on Linux and then reads nothing.
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(status)) throw std::runtime_error(errors.is_directory);
  const bool file_or_pipe = std::filesystem::is_regular_file(status) || std::filesystem::is_fifo(status);
  if (!limits.not_regular.empty() && std::filesystem::exists(status) && !file_or_pipe)
    throw std::runtime_error(limits.not_regular);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(errors.cannot_open);
  if (limits.max_bytes == SIZE_MAX) {
    std::ostringstream bytes;
    bytes << in.rdbuf();
    if (in.bad()) throw std::runtime_error(errors.read_failed);
    return bytes.str();
  }
  // One byte past the cap tells "too large" from "exactly the cap", without reading further.
  std::string bytes(limits.max_bytes + 1, '\0');
  in.read(&bytes[0], static_cast<std::streamsize>(bytes.size()));
  if (in.bad()) throw std::runtime_error(errors.read_failed);
  bytes.resize(static_cast<size_t>(in.gcount()));
  if (bytes.size() > limits.max_bytes) throw std::runtime_error(limits.too_large);
  return bytes;
}

}  // namespace train
}  // namespace fsdp
