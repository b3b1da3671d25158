// read_file.h — a whole file read into memory, for the config, the token file and tokenize.
// No torch: part of the fsdp_train_config library. Each caller words its own errors, since they
// name different keys and files.
#pragma once

#include <stdexcept>
#include <string>

namespace fsdp {
namespace train {

// The messages read_file throws, each complete (the caller puts the path where it reads well).
struct ReadFileErrors {
  std::string is_directory;  // the path names a directory
  std::string cannot_open;   // missing, or not readable
  std::string read_failed;   // opened, but reading stopped with an error
};

// The file's bytes; std::runtime_error with one of `errors` when it cannot be had.
std::string read_file(const std::string& path, const ReadFileErrors& errors);

}  // namespace train
}  // namespace fsdp
