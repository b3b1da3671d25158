// read_file.cpp — read_file of read_file.h.
#include "read_file.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

namespace fsdp {
namespace train {

std::string read_file(const std::string& path, const ReadFileErrors& errors) {
  // An ifstream opens a directory without complaint on Linux and then reads nothing.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw std::runtime_error(errors.is_directory);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(errors.cannot_open);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) throw std::runtime_error(errors.read_failed);
  return bytes.str();
}

}  // namespace train
}  // namespace fsdp
