#include "output.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <stdexcept>
#include <sys/stat.h>
#include <unistd.h>

namespace fsdprun {
namespace {

// A line that never ends (progress bars, binary junk) is shown in chunks of this size
// rather than buffered without bound.
constexpr std::size_t kMaxPartialLine = 64 * 1024;

void make_dirs(const std::string& dir) {
  for (std::size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("cannot create directory '" + prefix + "': " + std::strerror(errno));
  }
}

int open_log(const std::string& path) {
  make_dirs(path.substr(0, path.rfind('/')));
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot open log file '" + path + "': " + std::strerror(errno));
  return fd;
}

}  // namespace

void write_all(int fd, const char* data, std::size_t size) {
  while (size > 0) {
    const ssize_t n = write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

std::string log_file_path(const std::string& log_dir, int attempt, int rank, const std::string& stream) {
  return log_dir + "/attempt_" + std::to_string(attempt) + "/rank_" + std::to_string(rank) + "/" + stream + ".log";
}

StreamSink::StreamSink(std::string prefix, int console_fd, const std::string& log_path)
    : prefix_(std::move(prefix)), console_fd_(console_fd) {
  if (!log_path.empty()) log_fd_ = open_log(log_path);
}

StreamSink::~StreamSink() {
  finish();
  if (log_fd_ >= 0) close(log_fd_);
}

void StreamSink::consume(const char* data, std::size_t size) {
  if (log_fd_ >= 0) write_all(log_fd_, data, size);
  if (console_fd_ < 0) return;
  partial_.append(data, size);
  std::string lines;
  std::size_t start = 0;
  for (std::size_t nl; (nl = partial_.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines += prefix_;
    lines.append(partial_, start, nl + 1 - start);
  }
  partial_.erase(0, start);
  if (partial_.size() >= kMaxPartialLine) {
    lines += prefix_ + partial_ + "\n";
    partial_.clear();
  }
  if (!lines.empty()) write_all(console_fd_, lines.data(), lines.size());
}

void StreamSink::finish() {
  if (console_fd_ < 0 || partial_.empty()) return;
  const std::string line = prefix_ + partial_ + "\n";
  partial_.clear();
  write_all(console_fd_, line.data(), line.size());
}

}  // namespace fsdprun
