// read_file.h — a whole file read into memory, for the config, the token file and tokenize.
// No torch: part of the fsdp_train_config library. Each caller words its own errors, since they
// name different keys and files.
#pragma once

#include <cstdint>
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

// Optional limits, for files whose size the caller knows to be small (a config).
struct ReadFileLimits {
  size_t max_bytes = SIZE_MAX;  // a cap on the size (pipes are read up to it)
  std::string too_large;        // the message when the cap is passed
  // When set, anything but a regular file or a pipe (a device such as /dev/zero, a socket) is
  // refused with this message.
  std::string not_regular;
};

// The file's bytes; std::runtime_error with one of `errors` (or of `limits`) when it cannot be had.
std::string read_file(const std::string& path, const ReadFileErrors& errors, const ReadFileLimits& limits = {});

}  // namespace train
}  // namespace fsdp
