// checkpoint_write.h — the save that save_checkpoint and CheckpointManager share, and the
// durable file write both use.
#pragma once

#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

// Writes `state_dict` to `dir` over `world` (every rank of it calls this with its own pieces),
// in phases that each end with all ranks agreeing that it succeeded: when a phase fails on any
// rank, every rank throws the same c10::Error at once, one line per failed rank, and the
// temporary files of the failed save are removed. `commit`, when given, runs on rank 0 as the
// last phase, once the checkpoint is complete (the manager points `latest` at it and prunes).
// `attributes` go into metadata.json as they are (CheckpointManager::set_attributes).
void write_checkpoint(const std::string& dir, const ShardedStateDict& state_dict,
                      const std::shared_ptr<ProcessGroup>& world, const std::function<void()>& commit = nullptr,
                      const std::map<std::string, std::string>& attributes = {});

// Writes `bytes` to `path` durably: under `path`.tmp, fsync'ed, then renamed. On failure the
// temporary file is removed and a c10::Error names it.
void write_file_durably(const std::filesystem::path& path, const char* bytes, size_t n);

// The same for content written a piece at a time: `write(append)` calls append(bytes, n) for
// each piece in order, so that a file larger than memory needs no buffer of its own size.
// append throws (naming the temporary file) when a write fails.
using AppendBytes = std::function<void(const char* bytes, size_t n)>;
void write_file_durably(const std::filesystem::path& path, const std::function<void(const AppendBytes&)>& write);

// Runs `local_work` on every rank of `world`, then makes all ranks agree: if it threw anywhere,
// every rank throws "<who> failed while <phase>:", then each failed rank and its error, one line
// each (so nobody is left waiting in a collective). Collective; also acts as a barrier. Returns
// every rank's result string, in rank order.
std::vector<std::string> on_all_ranks(ProcessGroup& world, const char* who, const char* phase,
                                      const std::function<std::string()>& local_work);

// Whether this rank writes its piece of `d`: along every mesh dim that replicates `d` (all of
// them for a buffer, the replicate dim of an HSDP parameter) only the first rank does, so every
// piece is written by exactly one replica.
bool writes_piece(const DTensor& d);

// Makes a rename in `dir` durable (best effort: a file system that cannot sync a directory).
void fsync_dir(const std::filesystem::path& dir);

}  // namespace detail
}  // namespace fsdp
