// fsdp/checkpoint.h — distributed checkpoints on disk: each rank writes only its own shards,
// and a checkpoint loads at any world size (each rank reads only the byte ranges it needs).
//
//   fsdp::ShardedStateDict sd = fsdp::sharded_state_dict(*model);       // or a merged dict
//   fsdp::save_checkpoint("ckpt/step_100", sd);                           // collective
//   ...                                                                   // later, any world size:
//   auto loaded = fsdp::load_checkpoint("ckpt/step_100", fsdp::sharded_state_dict(*model));
//   fsdp::load_sharded_state_dict(*model, loaded);
//
// Layout of a checkpoint directory:
//   rank_<r>.data   the bytes of the pieces rank r held (row-major), one after another
//   metadata.json   written last, by rank 0, after every data file is complete and synced:
//                   the format version and, for every key, dtype, global shape and its chunks
//                   (global offsets and sizes, file, byte offset and length, CRC-32 of each
//                   1 MiB block). A directory without metadata.json is an incomplete save and
//                   is never loaded.
// Replicated values are written once (by the mesh's first rank). Every file is written under a
// temporary name, fsync'ed and renamed, so a process killed during a save leaves either the
// previous complete checkpoint or nothing that looks complete.
#pragma once

#include <fsdp/state_dict.h>

#include <memory>
#include <optional>
#include <string>

namespace fsdp {

// The on-disk format version this build writes; it reads this version and older ones.
constexpr int kCheckpointFormatVersion = 1;

// Writes `state_dict` to `dir` (created if needed; an earlier checkpoint there is replaced:
// its metadata is removed first). Collective over the world: every rank calls it with its own
// shards of the same keys. Blocks until the checkpoint is complete on disk. When a rank fails
// (a full disk, a path that is a file), every rank throws the same c10::Error, naming each
// failed rank and its error.
void save_checkpoint(const std::string& dir, const ShardedStateDict& state_dict);

// Reads the checkpoint at `dir` into new tensors laid out like `like` (same keys, dtypes and
// global shapes; any placements, e.g. those of a model sharded over another world size). Reads
// only the chunks overlapping this rank's pieces and verifies their checksums. Throws
// c10::Error, naming the file and the key, on: a missing directory or metadata.json, a damaged
// metadata.json, a newer format version, a missing or unexpected key, a dtype or shape
// mismatch, a truncated or corrupted data file.
// Writes nothing anywhere; load the result with load_sharded_state_dict(). Not collective
// (only file reads), but every rank normally calls it.
ShardedStateDict load_checkpoint(const std::string& dir, const ShardedStateDict& like);

// Keeps numbered checkpoints under a root directory: root/step_<N>, and root/latest naming the
// newest complete one (replaced atomically after the checkpoint is complete). Keeps the
// newest `keep` checkpoints (0 = all); pruning reads every step_* directory under the root,
// so keep nothing else of that name there. Not copyable; one per root. Use it from one thread.
class CheckpointManager {
 public:
  explicit CheckpointManager(std::string root, int keep = 0);
  // Waits for a background save; an error it hit is printed to stderr (a destructor cannot
  // throw): call wait() before to handle it.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Collective: saves root/step_<step>, then points `latest` at it and prunes old ones (rank 0).
  // Waits for a background save first. Returns the directory.
  std::string save(int64_t step, const ShardedStateDict& state_dict);
  // Collective: copies this rank's pieces into memory the training does not touch (the only
  // part that blocks), then writes, points `latest` and prunes in a background thread that
  // talks over a process group of its own. Waits for the previous background save first and
  // rethrows its error. The state dict may change as soon as this returns.
  void save_async(int64_t step, const ShardedStateDict& state_dict);
  // Waits for the background save, if any; rethrows the error it failed with.
  void wait();

  // The directory `latest` names, or nullopt when there is no complete checkpoint yet.
  // Not collective; reads one small file.
  std::optional<std::string> latest() const;
  // The step number of a directory written by save() (its name is step_<N>). Throws
  // c10::Error naming `dir` when the name is anything else.
  static int64_t step_of(const std::string& dir);

 private:
  struct Background;  // checkpoint.cpp
  std::string root_;
  int keep_;
  std::unique_ptr<Background> background_;
};

}  // namespace fsdp
