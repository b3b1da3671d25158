// run_lock.h — one job per checkpoint directory. Two jobs writing one fsdp_config.checkpoint_dir
// would prune each other's checkpoints, and a rerun would resume from the other job's weights;
// so rank 0 holds an exclusive lock on <checkpoint_dir>/.fsdp-train.lock for the whole run.
// The lock is flock(2): the kernel drops it when its holder exits or is killed, so a lock file
// left behind by a dead job never blocks the next one. The file's text (host, pid, start time)
// is only there to name the holder in the refusal.
#pragma once

#include <string>

namespace fsdp {
namespace train {

class CheckpointDirLock {
 public:
  CheckpointDirLock() = default;
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

  // Takes the lock of `dir` (which exists) without waiting. Returns "" when it is held from now
  // on, else why not: another live job holds it (naming its host, pid and start time, and what
  // to do), or the lock file cannot be opened. Not collective: rank 0 calls it.
  std::string acquire(const std::string& dir);

 private:
  int fd_ = -1;
};

// The lock file's name inside the checkpoint directory.
constexpr const char* kCheckpointDirLockFile = ".fsdp-train.lock";

}  // namespace train
}  // namespace fsdp
