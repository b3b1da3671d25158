// run_lock.cpp — the checkpoint directory's lock (run_lock.h).
#include "checkpoints/run_lock.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

namespace fsdp {
namespace train {
namespace {

// "host <h>, pid <p>, started <UTC time>": who holds the lock, as its holder wrote it.
std::string holder_description() {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "?");
  char when[64] = "?";
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  if (::gmtime_r(&now, &utc)) std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", &utc);
  return std::string("host ") + host + ", pid " + std::to_string(::getpid()) + ", started " + when;
}

// The holder's line, with anything but printable ASCII escaped: the file is ours, but another
// program may have written into it.
std::string read_holder(int fd) {
  char buf[512];
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "an unknown holder (the lock file is empty)";
  std::string out;
  for (ssize_t i = 0; i < n && buf[i] != '\n'; ++i) {
    const unsigned char c = static_cast<unsigned char>(buf[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char esc[8];
      std::snprintf(esc, sizeof(esc), "\\x%02x", c);
      out += esc;
    }
  }
  return out;
}

void write_holder(int fd) {
  const std::string line = holder_description() + "\n";
  if (::ftruncate(fd, 0) == 0 && ::pwrite(fd, line.data(), line.size(), 0) < 0) {
    // The text only names the holder in another job's refusal; the lock itself is held.
  }
}

}  // namespace

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::string CheckpointDirLock::acquire(const std::string& dir) {
  const std::string path = dir + "/" + kCheckpointDirLockFile;
  // O_NOFOLLOW: a lock "file" that is a link elsewhere is not ours to write into.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return "cannot open the lock file " + path + " (" + std::strerror(errno) + ")";
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = err == EWOULDBLOCK ? read_holder(fd) : "";
    ::close(fd);
    if (err != EWOULDBLOCK) return "cannot lock " + path + " (" + std::strerror(err) + ")";
    return dir + " is in use by another fsdp-train job (" + holder + ", as " + path +
           " says): two jobs in one checkpoint directory would prune each other's checkpoints and resume from "
           "each other's weights. Give this job its own fsdp_config.checkpoint_dir, or wait for that job to end";
  }
  fd_ = fd;
  write_holder(fd_);
  return "";
}

}  // namespace train
}  // namespace fsdp
