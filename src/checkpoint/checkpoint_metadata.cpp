// Reading a checkpoint's metadata.json into typed records, and the checks that make them safe to
// act on (see checkpoint_metadata.h). A damaged metadata file must never turn into a read outside
// a data file, a tensor with bytes nobody wrote, or an exception other than c10::Error.
#include "src/checkpoint/checkpoint_metadata.h"

#include <fsdp/checkpoint.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

namespace fsdp {
namespace detail {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string describe(const json& j) {
  if (j.is_number()) return "is the number " + j.dump();
  if (j.is_null()) return "is null";
  const std::string type = j.type_name();
  return std::string("is ") + (type[0] == 'a' || type[0] == 'o' ? "an " : "a ") + type;
}

// The dtype of the name the writer records (c10::toString), if this build reads it.
std::optional<at::ScalarType> dtype_named(const std::string& name) {
  for (at::ScalarType t : {at::kByte, at::kChar, at::kShort, at::kInt, at::kLong, at::kHalf, at::kFloat, at::kDouble,
                           at::kComplexFloat, at::kComplexDouble, at::kBool, at::kBFloat16}) {
    if (name == c10::toString(t)) return t;
  }
  return std::nullopt;
}

// Where a value is, for messages: "field 'files'", "key 'w', field 'chunks[0].offsets'".
std::string field(const std::string& name) { return "field '" + name + "'"; }
std::string entry_field(const std::string& key, const std::string& name) {
  return "key '" + printable(key) + "', field '" + name + "'";
}

// Reads the fields of one metadata file. Every error names the file, and the key and field.
class Parser {
 public:
  Parser(std::string who, std::string path) : who_(std::move(who)), path_(std::move(path)) {}

  CheckpointMetadata parse(const json& root) const {
    CheckpointMetadata meta;
    meta.path = path_;
    check_format(root);
    meta.world_size = integer(member(root, "world_size", field("world_size")), field("world_size"), 1);
    const int64_t block = integer(member(root, "block_bytes", field("block_bytes")), field("block_bytes"), 1);
    if (block != kCheckpointBlockBytes) {
      fail(field("block_bytes"), "is " + std::to_string(block) + "; this build reads " +
                                     std::to_string(kCheckpointBlockBytes) + "-byte blocks only");
    }
    const json& files = object(member(root, "files", field("files")), field("files"));
    for (const auto& f : files.items()) read_file_entry(f.key(), f.value(), &meta);
    const json& entries = object(member(root, "entries", field("entries")), field("entries"));
    for (const auto& e : entries.items()) meta.entries[e.key()] = entry(e.key(), e.value(), meta);
    read_attributes(root, &meta);
    return meta;
  }

 private:
  // Optional: checkpoints written before attributes existed have none.
  void read_attributes(const json& root, CheckpointMetadata* meta) const {
    const auto it = root.find("attributes");
    if (it == root.end()) return;
    for (const auto& a : object(*it, field("attributes")).items())
      meta->attributes[a.key()] = string(a.value(), "field 'attributes', entry '" + printable(a.key()) + "'");
  }

  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    TORCH_CHECK(false, who_, "'", path_, "' is damaged: ", where, " ", what, "; load an earlier checkpoint");
  }

  void check_format(const json& root) const {
    if (!root.is_object()) fail("the top level", describe(root) + ", expected an object");
    const auto format = root.find("format");
    TORCH_CHECK(format != root.end() && format->is_string() && *format == kCheckpointFormatName, who_, "'", path_,
                "' is not an fsdp-cpp checkpoint metadata file");
    const int64_t version = integer(member(root, "version", field("version")), field("version"));
    TORCH_CHECK(version >= 1 && version <= kCheckpointFormatVersion, who_, "'", path_, "' has format version ", version,
                "; this build reads versions 1 to ", kCheckpointFormatVersion, " (written by a newer fsdp-cpp?)");
  }

  const json& member(const json& obj, const char* name, const std::string& where) const {
    const auto it = obj.find(name);
    if (it == obj.end()) fail(where, "is missing");
    return *it;
  }
  const json& object(const json& j, const std::string& where) const {
    if (!j.is_object()) fail(where, describe(j) + ", expected an object");
    return j;
  }
  const json& array(const json& j, const std::string& where) const {
    if (!j.is_array()) fail(where, describe(j) + ", expected an array");
    return j;
  }
  int64_t integer(const json& j, const std::string& where, int64_t min = std::numeric_limits<int64_t>::min(),
                  int64_t max = std::numeric_limits<int64_t>::max()) const {
    if (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(max)) {
      fail(where, "is " + j.dump() + ", more than " + std::to_string(max));
    }
    if (!j.is_number_integer()) fail(where, describe(j) + ", expected an integer");
    const int64_t v = j.get<int64_t>();
    if (v < min || v > max)
      fail(where, "is " + std::to_string(v) + ", outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    return v;
  }
  std::vector<int64_t> integers(const json& j, const std::string& where, int64_t min, int64_t max) const {
    std::vector<int64_t> out;
    for (const json& v : array(j, where)) {
      // `where` ends with the field name's closing quote: the index goes inside it.
      const std::string element = where.substr(0, where.size() - 1) + "[" + std::to_string(out.size()) + "]'";
      out.push_back(integer(v, element, min, max));
    }
    return out;
  }
  std::string string(const json& j, const std::string& where) const {
    if (!j.is_string()) fail(where, describe(j) + ", expected a string");
    return j.get<std::string>();
  }

  void read_file_entry(const std::string& name, const json& size, CheckpointMetadata* meta) const {
    const std::string where = "field 'files', entry '" + printable(name) + "'";
    const int64_t rank = rank_of_data_file(name);
    if (rank < 0 || rank >= meta->world_size) {
      fail(where, "is not a data file this build writes (rank_<r>.data with r < world_size " +
                      std::to_string(meta->world_size) + ")");
    }
    meta->files[name] = integer(size, where, 0);
  }

  ChunkRecord chunk(const std::string& key, const std::string& at, const json& j) const {
    object(j, entry_field(key, at));
    auto get = [&](const char* name) -> const json& { return member(j, name, entry_field(key, at + "." + name)); };
    auto where = [&](const char* name) { return entry_field(key, at + "." + name); };
    ChunkRecord c;
    c.offsets = integers(get("offsets"), where("offsets"), 0, std::numeric_limits<int64_t>::max());
    c.sizes = integers(get("sizes"), where("sizes"), 0, std::numeric_limits<int64_t>::max());
    c.file = string(get("file"), where("file"));
    c.byte_offset = integer(get("byte_offset"), where("byte_offset"), 0);
    c.byte_length = integer(get("byte_length"), where("byte_length"), 0);
    for (int64_t v : integers(get("crc32"), where("crc32"), 0, std::numeric_limits<uint32_t>::max())) {
      c.crc32.push_back(static_cast<uint32_t>(v));
    }
    return c;
  }

  EntryRecord entry(const std::string& key, const json& j, const CheckpointMetadata& meta) const {
    object(j, "key '" + printable(key) + "'");
    EntryRecord e;
    const std::string dtype = string(member(j, "dtype", entry_field(key, "dtype")), entry_field(key, "dtype"));
    const std::optional<at::ScalarType> t = dtype_named(dtype);
    if (!t) fail(entry_field(key, "dtype"), "is '" + printable(dtype) + "', not a dtype this build reads");
    e.dtype = *t;
    e.shape = integers(member(j, "shape", entry_field(key, "shape")), entry_field(key, "shape"), 0,
                       std::numeric_limits<int64_t>::max());
    const json& chunks = array(member(j, "chunks", entry_field(key, "chunks")), entry_field(key, "chunks"));
    for (const json& c : chunks) e.chunks.push_back(chunk(key, "chunks[" + std::to_string(e.chunks.size()) + "]", c));
    check_geometry(key, e, meta);
    return e;
  }

  // The product of `dims` times `factor`, failing when it does not fit in 64 bits.
  int64_t product(const std::vector<int64_t>& dims, int64_t factor, const std::string& where) const {
    int64_t out = factor;
    for (int64_t d : dims) {
      if (__builtin_mul_overflow(out, d, &out)) fail(where, "describes more bytes than fit in 64 bits");
    }
    return out;
  }

  // The chunks of `e` tile its shape exactly, each stored in bytes consistent with the dtype and
  // inside the data file it names.
  void check_geometry(const std::string& key, const EntryRecord& e, const CheckpointMetadata& meta) const {
    const int64_t elem = static_cast<int64_t>(c10::elementSize(e.dtype));
    const int64_t bytes = product(e.shape, elem, entry_field(key, "shape"));
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      const std::string at = "chunks[" + std::to_string(i) + "]";
      const ChunkRecord& c = e.chunks[i];
      if (c.offsets.size() != e.shape.size() || c.sizes.size() != e.shape.size()) {
        fail(entry_field(key, at), "has " + std::to_string(c.offsets.size()) + " offsets and " +
                                       std::to_string(c.sizes.size()) + " sizes for a shape of " +
                                       std::to_string(e.shape.size()) + " dims");
      }
    }
    if (e.shape.empty()) {
      if (e.chunks.size() != 1) {
        fail("key '" + printable(key) + "'",
             "is a scalar with " + std::to_string(e.chunks.size()) + " chunks; a scalar is stored in exactly one");
      }
    } else if (bytes == 0) {
      if (!e.chunks.empty()) {
        fail("key '" + printable(key) + "'",
             "has " + std::to_string(e.chunks.size()) + " chunks but its shape holds no elements");
      }
    } else {
      check_tiling(key, e);
    }
    // A scalar is one chunk of one element; an empty entry has no chunks to check. Every chunk
    // lies inside the shape (checked), so its element count cannot overflow.
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      int64_t numel = 1;
      for (int64_t s : e.chunks[i].sizes) numel *= s;
      check_bytes(key, "chunks[" + std::to_string(i) + "]", e.chunks[i], numel, elem, meta);
    }
  }

  // The chunks cover the shape exactly: each is a box inside it, no two overlap, and their
  // elements add up to the shape's. Checkpoints of parameters sharded along one dim (dim 0, or
  // the dim a shard_placement_fn chose) split every chunk along that one dim only: then the
  // check runs along it and names the uncovered or doubly covered indices.
  void check_tiling(const std::string& key, const EntryRecord& e) const {
    std::vector<size_t> split_dims;
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      const ChunkRecord& c = e.chunks[i];
      for (size_t d = 0; d < e.shape.size(); ++d) {
        if (c.sizes[d] < 1 || c.offsets[d] > e.shape[d] - c.sizes[d]) {
          fail(entry_field(key, "chunks[" + std::to_string(i) + "]"),
               "holds " + std::to_string(c.sizes[d]) + " " + indices(d) + " from " + index(d) + " " +
                   std::to_string(c.offsets[d]) + ", outside the " + std::to_string(e.shape[d]) + " " + indices(d) +
                   " of the shape");
        }
        const bool whole = c.offsets[d] == 0 && c.sizes[d] == e.shape[d];
        if (!whole && std::find(split_dims.begin(), split_dims.end(), d) == split_dims.end()) split_dims.push_back(d);
      }
    }
    if (split_dims.size() <= 1) {
      check_tiling_along(key, e, split_dims.empty() ? 0 : split_dims.front());
    } else {
      check_boxes(key, e);
    }
  }

  // "rows" along dim 0, "indices of dim d" along another.
  static std::string indices(size_t d) { return d == 0 ? "rows" : "indices of dim " + std::to_string(d); }
  static std::string index(size_t d) { return d == 0 ? "row" : "index"; }

  // Every chunk spans all dims but `dim` whole: along `dim` they cover [0, size) with no gap and
  // no overlap.
  void check_tiling_along(const std::string& key, const EntryRecord& e, size_t dim) const {
    const int64_t size = e.shape[dim];
    std::vector<size_t> order(e.chunks.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return e.chunks[a].offsets[dim] < e.chunks[b].offsets[dim]; });
    int64_t covered = 0;  // [0, covered) is in a chunk
    for (size_t i : order) {
      const int64_t begin = e.chunks[i].offsets[dim];
      if (begin > covered) {
        fail("key '" + printable(key) + "'", "has no chunk for " + indices(dim) + " " + range(covered, begin));
      }
      if (begin < covered) {
        fail("key '" + printable(key) + "'", "has two chunks holding " + index(dim) + " " + std::to_string(begin) +
                                                 (dim == 0 ? "" : " of dim " + std::to_string(dim)) + " (chunks[" +
                                                 std::to_string(i) + "] overlaps another)");
      }
      covered = begin + e.chunks[i].sizes[dim];  // <= size, checked above
    }
    if (covered < size) {
      fail("key '" + printable(key) + "'", "has no chunk for " + indices(dim) + " " + range(covered, size));
    }
  }

  // Chunks split along several dims (e.g. a DTensor sharded over two mesh dims): boxes inside
  // the shape (checked) that do not overlap cover it exactly when their elements add up to it.
  void check_boxes(const std::string& key, const EntryRecord& e) const {
    for (size_t i = 0; i < e.chunks.size(); ++i) {
      for (size_t j = i + 1; j < e.chunks.size(); ++j) {
        bool overlap = true;
        for (size_t d = 0; d < e.shape.size() && overlap; ++d) {
          const ChunkRecord &a = e.chunks[i], &b = e.chunks[j];
          overlap = a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
        }
        if (overlap) {
          fail("key '" + printable(key) + "'",
               "has overlapping chunks: chunks[" + std::to_string(i) + "] and chunks[" + std::to_string(j) + "]");
        }
      }
    }
    int64_t total = 1, covered = 0;  // no overlap and inside the shape: the sum cannot exceed it
    for (int64_t s : e.shape) total *= s;
    for (const ChunkRecord& c : e.chunks) {
      int64_t n = 1;
      for (int64_t s : c.sizes) n *= s;
      covered += n;
    }
    if (covered < total) {
      fail("key '" + printable(key) + "'",
           "has gaps: its chunks hold " + std::to_string(covered) + " of its " + std::to_string(total) + " elements");
    }
  }
  static std::string range(int64_t begin, int64_t end) {
    return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
  }

  void check_bytes(const std::string& key, const std::string& at, const ChunkRecord& c, int64_t numel,
                   int64_t element_bytes, const CheckpointMetadata& meta) const {
    const int64_t want = numel * element_bytes;  // at most the entry's bytes: no overflow
    if (c.byte_length != want) {
      fail(entry_field(key, at + ".byte_length"), "is " + std::to_string(c.byte_length) + "; the chunk's " +
                                                      "elements take " + std::to_string(want) + " bytes");
    }
    const auto file = meta.files.find(c.file);
    if (file == meta.files.end()) {
      fail(entry_field(key, at + ".file"), "is '" + printable(c.file) + "', which field 'files' does not list");
    }
    if (c.byte_offset > file->second || c.byte_length > file->second - c.byte_offset) {
      fail(entry_field(key, at), "lies outside '" + c.file + "': " + std::to_string(c.byte_length) +
                                     " bytes at offset " + std::to_string(c.byte_offset) + " of a file of " +
                                     std::to_string(file->second));
    }
    const int64_t blocks = c.byte_length / kCheckpointBlockBytes + (c.byte_length % kCheckpointBlockBytes != 0);
    if (static_cast<int64_t>(c.crc32.size()) != blocks) {
      fail(entry_field(key, at + ".crc32"), "has " + std::to_string(c.crc32.size()) + " checksums; " +
                                                std::to_string(c.byte_length) + " bytes need " +
                                                std::to_string(blocks));
    }
  }

  std::string who_, path_;
};

json read_json(const fs::path& meta, const std::string& who) {
  std::error_code ec;
  TORCH_CHECK(fs::is_regular_file(meta, ec), who, "'", meta.string(), "' is not a regular file");
  std::ifstream f(meta, std::ios::binary);
  TORCH_CHECK(f, who, "'", meta.string(), "' cannot be opened");
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  TORCH_CHECK(!f.bad(), who, "'", meta.string(), "' cannot be read");
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    // Without the library's "[json.exception.parse_error.101] " tag: the position and the problem.
    const std::string what = e.what();
    const size_t tag_end = what.rfind("] ", what.find(' '));
    TORCH_CHECK(false, who, "'", meta.string(),
                "' is not valid JSON: ", tag_end == std::string::npos ? what : what.substr(tag_end + 2));
  }
}

}  // namespace

std::string data_file_name(int64_t rank) { return "rank_" + std::to_string(rank) + ".data"; }

int64_t rank_of_data_file(const std::string& name) {
  const std::string prefix = "rank_", suffix = ".data";
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  const std::string digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (digits.size() > 18 || (digits.size() > 1 && digits[0] == '0') ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  int64_t rank = 0;
  for (char c : digits) rank = rank * 10 + (c - '0');  // at most 18 digits: no overflow
  return rank;
}

std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 80; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c != 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return s.size() > 80 ? out + "..." : out;
}

CheckpointMetadata read_checkpoint_metadata(const std::string& dir_name, const std::string& who) {
  const fs::path dir(dir_name);
  const fs::path meta = dir / kMetadataFile;
  try {
    std::error_code ec;
    TORCH_CHECK(fs::is_directory(dir, ec), who, "checkpoint directory '", dir.string(), "' does not exist",
                ec ? " (" + ec.message() + ")" : std::string());
    TORCH_CHECK(fs::exists(meta, ec), who, "'", meta.string(), "' is missing: '", dir.string(),
                "' is not a complete checkpoint (its save did not finish)");
    return Parser(who, meta.string()).parse(read_json(meta, who));
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {  // e.g. std::bad_alloc for an absurd file
    TORCH_CHECK(false, who, "'", meta.string(), "' cannot be read: ", e.what());
  }
}

std::optional<DataFileProblem> find_data_file_problem(const std::string& dir_name, const CheckpointMetadata& meta) {
  const fs::path dir(dir_name);
  std::error_code dir_ec;
  const fs::path real_dir = fs::canonical(dir, dir_ec);
  for (const auto& [name, recorded] : meta.files) {
    DataFileProblem p{(dir / name).string(), name, -1, recorded, ""};
    std::error_code ec;
    const fs::file_status status = fs::status(p.path, ec);
    if (!fs::exists(status)) {
      p.predicate = "is missing";
    } else if (!fs::is_regular_file(status)) {
      p.predicate = "is not a regular file";
    } else if (fs::canonical(p.path, ec).parent_path() != real_dir || ec || dir_ec) {
      p.predicate = "resolves outside '" + dir.string() + "' (a symbolic link?)";
    } else {
      const auto size = fs::file_size(p.path, ec);
      if (!ec && static_cast<int64_t>(size) == recorded) continue;
      p.actual = ec ? -1 : static_cast<int64_t>(size);
      p.predicate =
          ec ? "cannot be read: " + ec.message()
             : "is " + std::to_string(size) + " bytes, " + kMetadataFile + " says " + std::to_string(recorded);
    }
    return p;
  }
  return std::nullopt;
}

}  // namespace detail
}  // namespace fsdp
