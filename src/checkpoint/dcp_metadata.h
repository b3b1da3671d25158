// dcp_metadata.h — the `.metadata` file of a PyTorch Distributed Checkpoint (DCP) directory as
// typed records: read with a strict unpickler that builds only the classes DCP writes (see
// kDcpGlobals in dcp_metadata.cpp) and checks every field, and written as a pickle that
// Python's pickle.load turns into torch.distributed.checkpoint.metadata.Metadata.
//
// This file owns the metadata only; dcp.cpp reads and writes the data files it describes. It
// never imports, calls or executes anything named in a pickle: a GLOBAL outside the allow-list
// is refused with an error naming the file and the class.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

constexpr const char* kDcpMetadataFile = ".metadata";

// Where an item's bytes lie: [offset, offset + length) of `file` (a plain name in the directory).
struct DcpStorage {
  std::string file;
  int64_t offset = 0, length = 0;
};

// One chunk of a tensor entry: the box [offsets, offsets + sizes) of the global tensor, stored
// as a torch.save archive of exactly that box.
struct DcpChunk {
  std::vector<int64_t> offsets, sizes;
  DcpStorage storage;
};

// One key of the checkpoint: a tensor (dtype, global shape, chunks tiling it) or a BYTE_IO
// value (a torch.save archive of a Python object) stored in one place.
struct DcpEntry {
  bool is_bytes = false;
  at::ScalarType dtype = at::kFloat;  // tensors
  std::vector<int64_t> shape;         // tensors
  std::vector<DcpChunk> chunks;       // tensors: tile `shape` exactly (checked)
  DcpStorage bytes;                   // BYTE_IO values
};

struct DcpMetadata {
  std::string path;                         // the .metadata file, for messages
  std::map<std::string, DcpEntry> entries;  // flattened key -> its record
  // The original (nested) path of each flattened key, as DCP's planner_data records it: strings
  // and list indices, e.g. ("optimizer", "param_groups", 0, "lr"). Written, not read.
  struct PathPart {
    std::string name;    // a dict key
    int64_t index = -1;  // a list index (when >= 0; then `name` is unused)
  };
  std::map<std::string, std::vector<PathPart>> planner_paths;
};

// Reads and checks `dir`/.metadata. Accepts pickle protocols 2 to 5 and only the opcodes and
// GLOBALs that DCP's metadata needs. Checks every field's type, that each entry's chunks tile its
// shape (inside it, no overlap, no gap; a scalar in exactly one chunk; one storage record per
// chunk and per BYTE_IO value), that every storage record names a plain file `__<r>_<n>.distcp`
// of `dir` and has no transform (compression) descriptors. Throws c10::Error, beginning with
// `who` and naming the file (and the key where one is at fault), on anything else. Does not look
// at the data files.
DcpMetadata read_dcp_metadata(const std::string& dir, const std::string& who);

// The pickle (protocol 2) of a Metadata holding `meta`'s entries, their storage records and
// planner paths, StorageMeta(checkpoint_id=`checkpoint_id`, save_id=`save_id`) and version 1.0.0.
std::string write_dcp_metadata(const DcpMetadata& meta, const std::string& checkpoint_id, const std::string& save_id);

// The pickle (protocol 2) of a torch.save data.pkl for one plain value, or for one tensor whose
// storage is record "data/0": the pieces dcp.cpp puts into archives.
struct PickleWriter {
  std::string out = std::string("\x80\x02", 2);
  void none() { out += 'N'; }
  void boolean(bool b) { out += b ? '\x88' : '\x89'; }
  void integer(int64_t v);
  void real(double v);
  void str(const std::string& s);
  void global(const std::string& module, const std::string& name);
  void mark() { out += '('; }
  void tuple() { out += 't'; }  // MARK ... TUPLE
  void list() { out += 'l'; }   // MARK ... LIST
  void dict() { out += 'd'; }   // MARK ... DICT
  void empty_tuple() { out += ')'; }
  void reduce() { out += 'R'; }
  void newobj() { out += '\x81'; }  // cls, args -> cls.__new__(cls, *args)
  void build() { out += 'b'; }
  void binpersid() { out += 'Q'; }
  void stop() { out += '.'; }
};

// The name torch uses for a dtype in pickles ("float32", "bfloat16"); throws for one DCP has none.
std::string dcp_dtype_name(at::ScalarType dtype);

}  // namespace detail
}  // namespace fsdp
