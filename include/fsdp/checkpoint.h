// layer: checkpoint (what may include what: docs/architecture.md)
/// \file
/// fsdp/checkpoint.h — distributed checkpoints on disk: each rank writes only its own shards,
/// and a checkpoint loads at any world size (each rank reads only the byte ranges it needs).
///
/// \code{.cpp}
///   fsdp::ShardedStateDict sd = fsdp::sharded_state_dict(*model);       // or a merged dict
///   fsdp::save_checkpoint("ckpt/step_100", sd);                           // collective
///   ...                                                                   // later, any world size:
///   auto loaded = fsdp::load_checkpoint("ckpt/step_100", fsdp::sharded_state_dict(*model));
///   fsdp::load_sharded_state_dict(*model, loaded);
/// \endcode
///
/// Layout of a checkpoint directory:
/// \code{.cpp}
///   rank_<r>.data   the bytes of the pieces rank r held (row-major), one after another
///   metadata.json   written last, by rank 0, after every data file is complete and synced:
///                   the format version and, for every key, dtype, global shape and its chunks
///                   (global offsets and sizes, file, byte offset and length, CRC-32 of each
///                   1 MiB block). A directory without metadata.json is an incomplete save and
///                   is never loaded.
/// \endcode
/// Replicated values are written once: along each mesh dim a value is replicated over, only the
/// first rank writes (a buffer by the mesh's first rank, an HSDP parameter's shard by the first
/// replica). Every file is written under a
/// temporary name (`<file>.tmp`), fsync'ed and renamed, so a process killed during a save leaves
/// either the previous complete checkpoint or nothing that looks complete. A save that fails
/// removes its temporaries; those of a killed one are removed by the next save into that
/// directory.
#pragma once

#include <fsdp/state_dict.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

/// The on-disk format version this build writes; it reads this version and older ones.
constexpr int kCheckpointFormatVersion = 1;

/// Writes `state_dict` to `dir` (created if needed; an earlier checkpoint there is replaced:
/// its metadata is removed first). Collective over the world: every rank calls it with its own
/// shards of the same keys. Blocks until the checkpoint is complete on disk. When a rank fails
/// (a full disk, a path that is a file), every rank throws the same c10::Error at once: a first
/// line naming the phase, then one line per failed rank with its error; the temporary files of
/// the failed save are removed.
void save_checkpoint(const std::string& dir, const ShardedStateDict& state_dict);

/// Reads the checkpoint at `dir` into new tensors laid out like `like` (same keys, dtypes and
/// global shapes; any placements, e.g. those of a model sharded over another world size or along
/// another dim: a checkpoint of Shard(1) parameters loads into Shard(0) ones). Reads
/// only the chunks overlapping this rank's pieces and verifies their checksums. Checks the
/// metadata in full before reading any data: every field's type and range, that the chunks of
/// every entry tile its global shape exactly (no gap, no overlap, inside the shape; a scalar in
/// exactly one chunk), that their byte lengths match the dtype and lie inside the data file
/// sizes the metadata records, and that every data file is a plain `rank_<r>.data` inside `dir`.
/// Throws c10::Error, naming the file and the key (and the field), on: a missing directory or
/// metadata.json, a damaged metadata.json (any of the above), a newer format version, a missing
/// or unexpected key, a dtype or shape mismatch, a missing, truncated or corrupted data file.
/// Writes nothing anywhere; load the result with load_sharded_state_dict(). Not collective
/// (only file reads), but every rank normally calls it.
ShardedStateDict load_checkpoint(const std::string& dir, const ShardedStateDict& like);

/// Keeps numbered checkpoints under a root directory: `root/step_<N>`, and root/latest naming the
/// newest complete one (replaced atomically after the checkpoint is complete). Pruning (keep > 0)
/// keeps the `keep` complete checkpoints with the largest N plus the one just saved, removes the
/// other complete ones and the incomplete ones older than the oldest kept; an incomplete
/// directory (e.g. one whose metadata.json is gone) never counts toward `keep`. Only directories
/// named exactly `step_<N>` are ever touched, and never a DCP checkpoint (fsdp/dcp.h: a .metadata
/// and no metadata.json) kept in the same root. Writing `latest` and pruning run on rank 0 inside the
/// save's all-ranks agreement: when they fail, every rank's save fails at once. Not copyable;
/// one per root. Use it from one thread.
class CheckpointManager {
 public:
  /// Manages the checkpoints under `root`, pruning to `keep` as above (0: never prunes).
  /// Not collective; touches no file until a save.
  explicit CheckpointManager(std::string root, int keep = 0);
  /// Waits for a background save; an error it hit is printed to stderr (a destructor cannot
  /// throw): call wait() before to handle it.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  /// Collective: saves `root/step_<step>`, then points `latest` at it and prunes old ones (rank 0).
  /// Waits for a background save first (rethrowing its error). Returns the directory.
  std::string save(int64_t step, const ShardedStateDict& state_dict);
  /// Collective: copies this rank's pieces into host memory the training does not touch (the
  /// only part that blocks; a GPU's pieces go to pinned host memory, as DCP's async save stages
  /// them, so the save needs no second copy of the state in GPU memory), then writes, points
  /// `latest` and prunes in a background thread that talks over a process group of its own.
  /// Waits for the previous background save first and rethrows its error. The state dict may
  /// change as soon as this returns.
  void save_async(int64_t step, const ShardedStateDict& state_dict);
  /// Waits for the background save, if any; rethrows the error it failed with.
  void wait();

  /// Not collective and never blocks: rethrows (once) the error a finished background save
  /// failed with; returns true while a background save is still running, false when none is
  /// (none was started, it succeeded, or its error was already thrown by poll() or wait()).
  bool poll();

  /// The directory `latest` names, or nullopt when there is no complete checkpoint yet. `latest`
  /// is read as scan() reads it (trimmed, and only an exact `step_<N>` counts); the directory must
  /// hold a metadata.json. Not collective; reads one small file.
  std::optional<std::string> latest() const;

  /// What the root holds, for resuming: where `latest` points and whether that is complete, and
  /// the newest complete `step_<N>` directory. Not collective; reads only small files (the
  /// metadata and the data files' sizes), so it is cheap but does not verify checksums. Never
  /// throws for what it finds: a missing root is an empty Scan; anything wrong is a finding.
  /// \code{.cpp}
  ///   latest_target     the content of `latest`, trimmed of white space at both ends
  ///   latest_complete   root/<latest_target>, set only when the target is exactly step_<N> and
  ///                     is_complete() holds for it
  ///   newest_complete   among the step_<N> directories, the complete one with the largest N
  ///   findings          e.g. "ckpt/latest is empty", "ckpt/latest does not hold a step_<N> name
  ///                     (6 bytes, not shown)" (only a `step_<N>` name is ever quoted), "ckpt/latest
  ///                     is a symbolic link, not the file a save writes; it is not read",
  ///                     "ckpt/latest names 'step_20', which has no
  ///                     metadata.json (an incomplete save)", "ckpt/step_15 is incomplete:
  ///                     ckpt/step_15/rank_1.data is 12 bytes, metadata.json says 4096", and
  ///                     "ckpt/latest is missing; ..." or "... but ckpt/step_30 is newer and
  ///                     complete" when `latest` lags behind newest_complete
  /// \endcode
  struct Scan {
    bool has_latest_file = false;                ///< root/latest exists
    std::string latest_target;                   ///< its content, trimmed (empty if none)
    std::optional<std::string> latest_complete;  ///< `root/<latest_target>`, when it is complete
    std::optional<std::string> newest_complete;  ///< the complete `step_<N>` with the largest N
    std::vector<std::string> findings;           ///< one line per problem found, naming its path
  };
  Scan scan() const;  ///< what is under the root now (see Scan). Not collective.

  /// True when `dir` holds a complete checkpoint: a metadata.json this build reads (checked as
  /// load_checkpoint checks it), and every data file it lists present, inside `dir`, with the
  /// size it records. Otherwise false, and `why` (when not null) is one line naming the path,
  /// e.g. "ckpt/step_20 has no metadata.json (an incomplete save)". Not collective; never throws
  /// for a bad `dir`; does not read the data (nor verify checksums).
  static bool is_complete(const std::string& dir, std::string* why = nullptr);

  /// Name-value pairs recorded in the metadata.json of every checkpoint saved from now on (by
  /// save() and save_async()), e.g. what a resume must match. Not collective; every rank may
  /// call it, rank 0's are the ones written. Replaces the previous ones.
  void set_attributes(std::map<std::string, std::string> attributes);
  /// The attributes recorded in the checkpoint at `dir`: empty for one saved without any (or by
  /// a build before attributes existed). Not collective; reads metadata.json only. Throws
  /// c10::Error naming the file when it is missing or damaged.
  static std::map<std::string, std::string> attributes(const std::string& dir);
  /// The step number of a directory written by save() (its name is `step_<N>`). Throws
  /// c10::Error naming `dir` when the name is anything else.
  static int64_t step_of(const std::string& dir);

 private:
  struct Background;  ///< checkpoint_manager.cpp
  std::string root_;
  int keep_;
  std::unique_ptr<Background> background_;
};

}  // namespace fsdp
