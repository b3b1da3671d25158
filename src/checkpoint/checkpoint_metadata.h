// checkpoint_metadata.h — a checkpoint's metadata.json as typed records, parsed and checked in
// full before anything trusts it: the type of every field, that the chunks of every entry tile
// its global shape exactly, that every byte range lies inside the data file sizes the metadata
// records, and that every data file is a plain rank_<r>.data inside the checkpoint directory.
// Shared by load_checkpoint and CheckpointManager (which reads it to tell complete checkpoints
// from incomplete ones). Reads only the metadata and the data files' sizes, never their bytes.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

constexpr const char* kMetadataFile = "metadata.json";
constexpr const char* kCheckpointFormatName = "fsdp-cpp distributed checkpoint";
constexpr int64_t kCheckpointBlockBytes = int64_t{1} << 20;  // the CRC-32 granularity

// The name of rank r's data file.
std::string data_file_name(int64_t rank);

// r for a name that is exactly rank_<r>.data, r written as data_file_name writes it (no sign,
// no leading zeros, at most 18 digits); -1 for any other name.
int64_t rank_of_data_file(const std::string& name);

// Untrusted text (a key, a file name) for a one-line message: control bytes escaped as \xNN,
// cut after 80 bytes.
std::string printable(const std::string& s);

// One piece of an entry: the box [offsets, offsets + sizes) of the global tensor, stored
// row-major at [byte_offset, byte_offset + byte_length) of `file`, with a CRC-32 per block.
struct ChunkRecord {
  std::vector<int64_t> offsets, sizes;
  std::string file;
  int64_t byte_offset = 0, byte_length = 0;
  std::vector<uint32_t> crc32;
};

struct EntryRecord {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  std::vector<ChunkRecord> chunks;  // tile `shape` exactly (checked), along any dims
};

struct CheckpointMetadata {
  std::string path;  // the metadata file, for messages
  int64_t world_size = 0;
  std::map<std::string, int64_t> files;           // data file name -> its size in bytes
  std::map<std::string, EntryRecord> entries;     // key -> its record
  std::map<std::string, std::string> attributes;  // what the writer recorded of itself; may be empty
};

// Reads and checks `dir`/metadata.json. Throws c10::Error whose message is `who` followed by a
// sentence naming the metadata file (and the key and field where one is at fault) on: a missing
// directory or file, text that is not JSON, another format, a newer version, a field missing or
// of the wrong type, numbers out of range, chunks that leave gaps, overlap or run outside the
// shape, sizes inconsistent with the dtype, byte ranges outside the recorded file sizes, a data
// file name that is not rank_<r>.data (r < world_size). Nothing else escapes it.
CheckpointMetadata read_checkpoint_metadata(const std::string& dir, const std::string& who);

// A data file that does not match the metadata.
struct DataFileProblem {
  std::string path;       // dir/<file>
  std::string file;       // the name listed in the metadata
  int64_t actual = -1;    // its size on disk; -1 when it is missing or not a regular file
  int64_t recorded = 0;   // what the metadata records
  std::string predicate;  // what is wrong, to follow the path: "is 12 bytes, metadata.json says 4096"
};

// The first data file listed in `meta` that is missing, not a regular file, resolves outside
// `dir` (a symbolic link), or has another size than recorded; nullopt when all match. Never throws.
std::optional<DataFileProblem> find_data_file_problem(const std::string& dir, const CheckpointMetadata& meta);

}  // namespace detail
}  // namespace fsdp
