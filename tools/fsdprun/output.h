// Where worker output goes: console lines prefixed with the rank, raw bytes to log files.
#pragma once

#include <cstddef>
#include <string>

namespace fsdprun {

// One worker stream (stdout or stderr). Console output is written line by line, each
// line prefixed and sent with one write() so lines of different ranks never mix; the
// log file gets the bytes unchanged, as they arrive.
class StreamSink {
 public:
  // console_fd < 0: no console output; log_path empty: no log file.
  StreamSink(std::string prefix, int console_fd, const std::string& log_path);
  ~StreamSink();
  StreamSink(const StreamSink&) = delete;
  StreamSink& operator=(const StreamSink&) = delete;

  void consume(const char* data, std::size_t size);
  // Flushes a last line without newline (adding one on the console). Idempotent.
  void finish();

 private:
  std::string prefix_;
  int console_fd_;
  int log_fd_ = -1;
  std::string partial_;  // console bytes after the last newline
};

// DIR/attempt_K/rank_R/<stream>.log, where stream is "stdout" or "stderr".
std::string log_file_path(const std::string& log_dir, int attempt, int rank, const std::string& stream);

// Writes everything, retrying on EINTR/short writes; errors (closed console) are ignored.
void write_all(int fd, const char* data, std::size_t size);

}  // namespace fsdprun
