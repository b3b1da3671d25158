// errors.h — fsdp-train's exit codes, and the text of an error it prints: one line, and safe for
// a terminal. LibTorch's c10::Error::what() carries a C++ backtrace of a dozen frames; a user
// needs the message, once per rank.
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <exception>
#include <string>

namespace fsdp {
namespace train {

// Exit codes of fsdp-train.
constexpr int kExitOk = 0;
// A runtime failure: I/O, a collective (timeout), a failed checkpoint save, a damaged input file
// (token file, init_from), no complete checkpoint for resume: auto where checkpoints exist.
constexpr int kExitError = 1;
// A bad configuration or command line, found before training: keys, values, sizes the machine
// cannot hold, paths that cannot be used (checkpoint_dir, init_from, training.resume).
constexpr int kExitConfig = 2;
// A step's loss or gradient norm became NaN or infinite; that step was not applied or saved.
constexpr int kExitNonFinite = 3;
// A run stopped by SIGTERM/SIGINT exits 128 + the signal number after saving a checkpoint.

// The length of the valid UTF-8 sequence that starts at s[i]; 0 when none does.
inline size_t utf8_length(const std::string& s, size_t i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  size_t n = 0;
  if (c < 0x80) n = 1;
  else if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) n = 3;
  else if (c >= 0xf0 && c <= 0xf4) n = 4;
  for (size_t k = 1; k < n; ++k)
    if (i + k >= s.size() || (static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 0;
  return n;
}

// Text for the terminal with every byte that could act on it escaped as \xNN: control bytes
// (an ESC sequence from a YAML value or a checkpoint file would recolour or rewrite the screen)
// and bytes that are not part of valid UTF-8. Newlines and tabs are kept: some messages are one
// line per rank.
inline std::string terminal_safe(const std::string& s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = utf8_length(s, i);
    const bool control = c < 0x20 ? c != '\n' && c != '\t' : c == 0x7f;
    if (n == 0 || control) {
      out += std::string("\\x") + hex[c >> 4] + hex[c & 15];
      ++i;
    } else {
      out.append(s, i, n);
      i += n;
    }
  }
  return out;
}

inline std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace train
}  // namespace fsdp
