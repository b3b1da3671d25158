// The safetensors format: a per-rank writer for sharded state dicts (each tensor gathered to
// its one owner and streamed into that rank's file), the Hugging Face index, and a reader that
// validates every header field before trusting it.
#include <fsdp/safetensors.h>

#include "src/checkpoint/state_dict_pieces.h"

#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <tuple>
#include <vector>

#include <unistd.h>

// Tensors are written and read as raw memory; the format is little-endian.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "fsdp safetensors support assumes a little-endian host"
#endif

namespace fsdp {
namespace {

// ordered_json keeps the header in the order we write it (state-dict order) and the order of a
// file read back.
using Json = nlohmann::ordered_json;

struct DtypeName {
  at::ScalarType type;
  const char* name;
};
constexpr DtypeName kDtypes[] = {
    {at::kDouble, "F64"}, {at::kFloat, "F32"}, {at::kHalf, "F16"}, {at::kBFloat16, "BF16"}, {at::kLong, "I64"},
    {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},  {at::kByte, "U8"},       {at::kBool, "BOOL"}};

const char* dtype_name(at::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return d.name;
  }
  return nullptr;
}

bool dtype_from_name(const std::string& name, at::ScalarType* type) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return (*type = d.type), true;
  }
  return false;
}

int64_t nbytes_of(const DTensor& d) { return d.numel() * static_cast<int64_t>(c10::elementSize(d.scalar_type())); }

std::string shard_file_name(const std::string& prefix, int rank, int world) {
  char numbers[32];
  std::snprintf(numbers, sizeof(numbers), "-%05d-of-%05d", rank + 1, world);
  return prefix + numbers + ".safetensors";
}

using FilePtr = std::unique_ptr<std::FILE, int (*)(std::FILE*)>;

// A file written as "<path>.tmp" and renamed to `path` by commit(); removed if never committed,
// so that a failed save leaves no file that looks complete.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp"), f_(nullptr, std::fclose) {
    f_.reset(std::fopen(tmp_.c_str(), "wb"));
    TORCH_CHECK(f_, "fsdp::save_safetensors: cannot open '", tmp_, "' for writing: ", std::strerror(errno));
  }
  ~AtomicFile() {
    if (f_) std::remove(tmp_.c_str());  // not committed
  }
  void write(const void* data, size_t n) {
    TORCH_CHECK(n == 0 || std::fwrite(data, 1, n, f_.get()) == n, "fsdp::save_safetensors: writing '", tmp_,
                "' failed: ", std::strerror(errno));
    written_ += n;
  }
  void write_tensor(const at::Tensor& t) {
    const at::Tensor c = t.cpu().contiguous();
    write(c.data_ptr(), c.nbytes());
  }
  uint64_t written() const { return written_; }
  // The bytes reach the disk before the rename: otherwise a crash soon after could leave `path`
  // naming a file whose data was never written.
  void commit() {
    TORCH_CHECK(std::fflush(f_.get()) == 0, "fsdp::save_safetensors: writing '", tmp_,
                "' failed: ", std::strerror(errno));
    TORCH_CHECK(::fsync(::fileno(f_.get())) == 0, "fsdp::save_safetensors: fsync of '", tmp_,
                "' failed: ", std::strerror(errno));
    const bool closed = std::fclose(f_.release()) == 0;
    const int close_errno = errno;
    if (!closed) std::remove(tmp_.c_str());  // not committed
    TORCH_CHECK(closed, "fsdp::save_safetensors: writing '", tmp_, "' failed: ", std::strerror(close_errno));
    TORCH_CHECK(std::rename(tmp_.c_str(), path_.c_str()) == 0, "fsdp::save_safetensors: renaming '", tmp_, "' to '",
                path_, "' failed: ", std::strerror(errno));
  }

 private:
  std::string path_, tmp_;
  FilePtr f_;
  uint64_t written_ = 0;
};

// True when `text` can go into the JSON header (which must be UTF-8).
bool is_utf8(const std::string& text) {
  try {
    (void)Json(text).dump();
    return true;
  } catch (const Json::exception&) {
    return false;
  }
}

// Everything that could make ranks disagree or fail half-way is checked before any collective.
void check_entries(const ShardedStateDict& state_dict, int world, const SafetensorsOptions& options) {
  for (const auto& kv : options.metadata()) {
    TORCH_CHECK(is_utf8(kv.first) && is_utf8(kv.second), "fsdp::save_safetensors: metadata entry '", kv.first,
                "' is not UTF-8 text, which the safetensors header requires");
  }
  for (const auto& item : state_dict) {
    const DTensor& d = item.value();
    TORCH_CHECK(!item.key().empty() && item.key() != "__metadata__", "fsdp::save_safetensors: invalid tensor name '",
                item.key(), "'");
    TORCH_CHECK(is_utf8(item.key()), "fsdp::save_safetensors: tensor name '", item.key(),
                "' is not UTF-8 text, which the safetensors header requires");
    TORCH_CHECK(d.defined(), "fsdp::save_safetensors: '", item.key(), "' is an undefined DTensor");
    TORCH_CHECK(dtype_name(d.scalar_type()), "fsdp::save_safetensors: '", item.key(), "' has dtype ", d.scalar_type(),
                ", which safetensors cannot hold here (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");
    TORCH_CHECK(d.device_mesh().size() == world, "fsdp::save_safetensors: '", item.key(), "' lives on mesh ",
                d.device_mesh().str(), ", which does not span the world of ", world, " ranks");
  }
}

// Greedy balance by bytes, in state-dict order: each entry goes to the rank with the fewest bytes
// so far (the lowest such rank). Depends only on shapes and dtypes, so every rank agrees.
std::vector<int> assign_owners(const ShardedStateDict& state_dict, int world) {
  std::vector<int64_t> load(world, 0);
  std::vector<int> owner;
  for (const auto& item : state_dict) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[r] += nbytes_of(item.value());
    owner.push_back(r);
  }
  return owner;
}

// The JSON header of `rank`'s file, padded with spaces so that the data starts 8-byte aligned.
// Offsets follow state-dict order, the order in which the tensors are then written.
std::string make_header(const ShardedStateDict& state_dict, const std::vector<int>& owner, int rank,
                        const SafetensorsOptions& options) {
  Json header = Json::object();
  header["__metadata__"] = Json{{"format", "pt"}};
  for (const auto& kv : options.metadata()) header["__metadata__"][kv.first] = kv.second;
  int64_t offset = 0;
  size_t i = 0;
  for (const auto& item : state_dict) {
    if (owner[i++] != rank) continue;
    const DTensor& d = item.value();
    const int64_t end = offset + nbytes_of(d);
    header[item.key()] =
        Json{{"dtype", dtype_name(d.scalar_type())}, {"shape", d.sizes()}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  return text;
}

void write_u64_le(AtomicFile& out, uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  out.write(b, 8);
}

// Writes this rank's file. Every rank walks the whole state dict because gathering a sharded
// entry is collective; only the owner keeps (and writes) the result.
void write_rank_file(const ShardedStateDict& state_dict, const std::vector<int>& owner, int rank,
                     const std::string& path, const SafetensorsOptions& options) {
  AtomicFile out(path);
  const std::string header = make_header(state_dict, owner, rank, options);
  write_u64_le(out, header.size());
  out.write(header.data(), header.size());
  uint64_t expected = 8 + header.size();
  size_t i = 0;
  for (const auto& item : state_dict) {
    const bool mine = owner[i++] == rank;
    const DTensor& d = item.value();
    if (mine) expected += nbytes_of(d);
    if (detail::all_replicate(d.placements())) {
      if (mine) out.write_tensor(d.to_local());
      continue;
    }
    const at::Tensor full = d.full_tensor();  // collective; dropped at once by non-owners
    if (mine) out.write_tensor(full);
  }
  TORCH_CHECK(out.written() == expected, "fsdp::save_safetensors: internal error: wrote ", out.written(), " bytes to '",
              path, "' instead of ", expected);
  out.commit();
}

void write_index(const ShardedStateDict& state_dict, const std::vector<int>& owner, int world, const std::string& dir,
                 const SafetensorsOptions& options) {
  int64_t total = 0;
  Json weight_map = Json::object();
  size_t i = 0;
  for (const auto& item : state_dict) {
    total += nbytes_of(item.value());
    weight_map[item.key()] = shard_file_name(options.prefix(), owner[i++], world);
  }
  const Json index{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  AtomicFile out(dir + "/" + options.prefix() + ".safetensors.index.json");
  out.write(text.data(), text.size());
  out.commit();
}

}  // namespace

void save_safetensors(const ShardedStateDict& state_dict, const std::string& dir, const SafetensorsOptions& options) {
  const int world = get_world_size();
  const int rank = get_rank();
  check_entries(state_dict, world, options);
  std::error_code ec, exists_ec;
  std::filesystem::create_directories(dir, ec);  // every rank: the ranks may not share a node
  TORCH_CHECK(std::filesystem::is_directory(dir, exists_ec), "fsdp::save_safetensors: cannot create directory '", dir,
              "': ", ec ? ec.message() : exists_ec.message());
  const std::vector<int> owner = assign_owners(state_dict, world);
  write_rank_file(state_dict, owner, rank, dir + "/" + shard_file_name(options.prefix(), rank, world), options);
  fsdp::world()->barrier()->wait();  // every rank's file is in place
  if (rank == 0) write_index(state_dict, owner, world, dir, options);
  fsdp::world()->barrier()->wait();  // so that no rank returns before the index exists
}

namespace {

// One tensor of a file being read, after its header entry was checked.
struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;  // relative to the start of the data
};

bool as_u64(const Json& v, uint64_t* out) {
  if (!v.is_number_unsigned()) return false;
  *out = v.get<uint64_t>();
  return true;
}

// Checks one header entry against the data's size; errors say which file and which tensor.
// `api` names the public function in errors (load_safetensors_file or load_safetensors).
Entry parse_entry(const std::string& path, const std::string& name, const Json& v, uint64_t data_size,
                  const char* api) {
  const std::string where = std::string(api) + ": '" + path + "': tensor '" + name + "': ";
  TORCH_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"), where,
              "expected an object with dtype, shape and data_offsets, got ", v.dump());
  Entry e{name, at::kFloat, {}, 0, 0};
  TORCH_CHECK(v["dtype"].is_string() && dtype_from_name(v["dtype"].get<std::string>(), &e.dtype), where,
              "unknown dtype ", v["dtype"].dump());
  const Json& shape = v["shape"];
  const Json& offsets = v["data_offsets"];
  TORCH_CHECK(shape.is_array(), where, "shape is not an array: ", shape.dump());
  uint64_t nbytes = c10::elementSize(e.dtype);
  for (const Json& s : shape) {
    uint64_t dim = 0;
    TORCH_CHECK(as_u64(s, &dim) && dim <= static_cast<uint64_t>(INT64_MAX), where, "bad shape ", shape.dump());
    TORCH_CHECK(!__builtin_mul_overflow(nbytes, dim, &nbytes), where, "shape ", shape.dump(), " is too large");
    e.shape.push_back(static_cast<int64_t>(dim));
  }
  TORCH_CHECK(offsets.is_array() && offsets.size() == 2 && as_u64(offsets[0], &e.begin) && as_u64(offsets[1], &e.end) &&
                  e.begin <= e.end,
              where, "bad data_offsets ", offsets.dump());
  TORCH_CHECK(e.end <= data_size, where, "data_offsets ", offsets.dump(), " run past the end of the data (", data_size,
              " bytes; truncated file?)");
  TORCH_CHECK(e.end - e.begin == nbytes, where, "data_offsets ", offsets.dump(), " span ", e.end - e.begin,
              " bytes but shape ", shape.dump(), " of ", v["dtype"].get<std::string>(), " needs ", nbytes);
  return e;
}

// The format requires the entries to cover the data exactly: no overlaps (which would alias two
// tensors) and no holes (which could hide other content). Sorts `entries` by offset.
void check_tiling(const std::string& path, std::vector<Entry>& entries, uint64_t data_size, const char* api) {
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  uint64_t cursor = 0;
  const std::string* previous = nullptr;
  for (const Entry& e : entries) {
    TORCH_CHECK(e.begin >= cursor, api, ": '", path, "': the data of tensor '", e.name, "' overlaps that of '",
                *previous, "'");
    TORCH_CHECK(e.begin == cursor, api, ": '", path, "': bytes [", cursor, ", ", e.begin, ") before tensor '", e.name,
                "' belong to no tensor");
    cursor = e.end;
    previous = &e.name;
  }
  TORCH_CHECK(cursor == data_size, api, ": '", path, "': the last ", data_size - cursor,
              " bytes of the data belong to no tensor");
}

// Reads the 8-byte length and the JSON header; leaves `f` at the start of the data.
Json read_header(const std::string& path, std::FILE* f, uint64_t file_size, uint64_t* data_size, const char* api) {
  const std::string where = std::string(api) + ": '" + path + "': ";
  unsigned char b[8];
  TORCH_CHECK(file_size >= 8 && std::fread(b, 1, 8, f) == 8, where, "the file is ", file_size,
              " bytes long, too short for the 8-byte header length (truncated?)");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(b[i]) << (8 * i);
  TORCH_CHECK(n <= file_size - 8, where, "the header length ", n, " exceeds the ", file_size - 8,
              " bytes after it (truncated or not a safetensors file?)");
  std::string text(n, '\0');
  TORCH_CHECK(std::fread(&text[0], 1, n, f) == n, where, "reading the header failed");
  *data_size = file_size - 8 - n;
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, where, "the header is not valid JSON: ", e.what());
  }
  TORCH_CHECK(header.is_object(), where, "the header is not a JSON object");
  return header;
}

// A file's checked header: where its data starts in the file, and its tensors by name.
struct FileIndex {
  uint64_t data_start = 0;
  std::map<std::string, Entry> entries;
};

FileIndex index_file(const std::string& path, std::FILE* f) {
  const long end = std::fseek(f, 0, SEEK_END) == 0 ? std::ftell(f) : -1;
  TORCH_CHECK(end >= 0, "fsdp::load_safetensors: cannot seek in '", path, "' (not a regular file?)");
  const auto file_size = static_cast<uint64_t>(end);
  std::rewind(f);
  uint64_t data_size = 0;
  const char* api = "fsdp::load_safetensors";
  const Json header = read_header(path, f, file_size, &data_size, api);
  std::vector<Entry> entries;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") {
      const Json& m = item.value();
      TORCH_CHECK(m.is_object() && std::all_of(m.begin(), m.end(), [](const Json& v) { return v.is_string(); }), api,
                  ": '", path, "': __metadata__ is not an object of strings");
      continue;
    }
    entries.push_back(parse_entry(path, item.key(), item.value(), data_size, api));
  }
  check_tiling(path, entries, data_size, api);
  FileIndex index;
  index.data_start = file_size - data_size;
  for (Entry& e : entries) index.entries.emplace(e.name, std::move(e));
  return index;
}

// name -> file (relative to dir): the index's weight_map, or every tensor of the one file
// <prefix>.safetensors when there is no index.
std::map<std::string, std::string> weight_map_of(const std::string& dir, const std::string& prefix) {
  namespace fs = std::filesystem;
  const fs::path index_path = fs::path(dir) / (prefix + ".safetensors.index.json");
  std::map<std::string, std::string> files;
  std::error_code ec;
  if (!fs::exists(index_path, ec)) {
    const std::string single = prefix + ".safetensors";
    TORCH_CHECK(fs::exists(fs::path(dir) / single, ec), "fsdp::load_safetensors: '", dir, "' has neither ",
                index_path.filename().string(), " nor ", single,
                "; pass the directory save_safetensors wrote (and "
                "its prefix in the options)");
    FilePtr f(std::fopen((fs::path(dir) / single).c_str(), "rb"), std::fclose);
    TORCH_CHECK(f, "fsdp::load_safetensors: cannot open '", (fs::path(dir) / single).string(),
                "': ", std::strerror(errno));
    for (const auto& item : index_file((fs::path(dir) / single).string(), f.get()).entries) files[item.first] = single;
    return files;
  }
  std::ifstream in(index_path);
  Json index;
  try {
    index = Json::parse(in);
  } catch (const Json::exception& e) {
    TORCH_CHECK(false, "fsdp::load_safetensors: '", index_path.string(), "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
              "fsdp::load_safetensors: '", index_path.string(), "' has no \"weight_map\" object");
  for (const auto& item : index["weight_map"].items()) {
    const Json& file = item.value();
    TORCH_CHECK(file.is_string(), "fsdp::load_safetensors: '", index_path.string(), "': the file of '", item.key(),
                "' is not a string");
    const std::string name = file.get<std::string>();
    // Only plain file names inside dir: an index must not point reads elsewhere.
    TORCH_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
                "fsdp::load_safetensors: '", index_path.string(), "': the file of '", item.key(), "' is '", name,
                "', not a file name inside the directory");
    files[item.key()] = name;
  }
  return files;
}

// This rank's piece of `target` from `entry` of the open file: only the bytes of its rows (a
// row-major tensor split along dim 0 is one contiguous range per piece). A piece split along
// another dim (a shard_placement_fn's Shard(d)) reads the whole rows it lies in, then keeps its
// part of them.
// The piece is read in the dtype stored; with `convert_float_dtypes` a floating dtype other than
// the model's is allowed and converted to it, another is not.
at::Tensor read_local_rows(const std::string& path, std::FILE* f, const FileIndex& index, const Entry& entry,
                           const DTensor& target, bool convert_float_dtypes) {
  const std::string where = "fsdp::load_safetensors: '" + path + "': tensor '" + entry.name + "': ";
  const bool converted = convert_float_dtypes && entry.dtype != target.scalar_type() &&
                         at::isFloatingType(entry.dtype) && at::isFloatingType(target.scalar_type());
  TORCH_CHECK(entry.dtype == target.scalar_type() || converted, where, "has dtype ", entry.dtype,
              " but the model's is ", target.scalar_type());
  TORCH_CHECK(entry.shape == target.sizes(), where, "has shape ", c10::IntArrayRef(entry.shape), " but the model's is ",
              c10::IntArrayRef(target.sizes()));
  at::Tensor local = at::empty(target.to_local().sizes(), at::TensorOptions().dtype(entry.dtype));
  if (local.numel() == 0) return local.to(target.scalar_type());
  uint64_t offset = entry.begin;
  at::Tensor rows = local;  // what is read: the piece itself, or the whole rows holding it
  std::vector<ChunkBounds> bounds;
  bool whole_rows = true;
  if (local.dim() > 0) {
    bounds = target.local_bounds();
    for (size_t d = 1; d < bounds.size(); ++d) {
      whole_rows = whole_rows && bounds[d].offset == 0 && bounds[d].length == target.sizes()[d];
    }
    if (!whole_rows) {
      std::vector<int64_t> shape = target.sizes();
      shape[0] = bounds[0].length;
      rows = at::empty(shape, local.options());
    }
    offset += static_cast<uint64_t>(bounds[0].offset) * (rows.nbytes() / static_cast<uint64_t>(rows.size(0)));
  }
  TORCH_CHECK(std::fseek(f, static_cast<long>(index.data_start + offset), SEEK_SET) == 0 &&
                  std::fread(rows.data_ptr(), 1, rows.nbytes(), f) == rows.nbytes(),
              where, "reading its bytes failed (truncated file?)");
  if (!whole_rows) {
    for (size_t d = 1; d < bounds.size(); ++d) {
      rows = rows.narrow(static_cast<int64_t>(d), bounds[d].offset, bounds[d].length);
    }
    local.copy_(rows);
  }
  return converted ? local.to(target.scalar_type()) : local;
}

// The model's key -> the files' name for it: itself, or without options.optional_key_prefix()
// when no tensor of the files carries that prefix.
std::map<std::string, std::string> file_names_of(const ShardedStateDict& like,
                                                 const std::map<std::string, std::string>& files,
                                                 const std::string& optional_prefix) {
  auto has_prefix = [&](const std::string& name) {
    return name.compare(0, optional_prefix.size(), optional_prefix) == 0;
  };
  bool strip = !optional_prefix.empty();
  for (const auto& item : files) strip = strip && !has_prefix(item.first);
  std::map<std::string, std::string> names;
  for (const auto& item : like)
    names[item.key()] = strip && has_prefix(item.key()) ? item.key().substr(optional_prefix.size()) : item.key();
  return names;
}

// Whether a tensor of the files that the model has not is one options.ignore_unexpected() skips.
bool ignored(const std::string& name, const std::vector<std::regex>& patterns) {
  for (const std::regex& p : patterns)
    if (std::regex_search(name, p)) return true;
  return false;
}

// options.ignore_unexpected()'s expressions, compiled once per load; an invalid one is refused by name.
std::vector<std::regex> compiled(const std::vector<std::string>& patterns) {
  std::vector<std::regex> out;
  for (const std::string& p : patterns) {
    try {
      out.emplace_back(p);
    } catch (const std::regex_error& e) {
      TORCH_CHECK(false, "fsdp::load_safetensors: ignore_unexpected: '", p, "' is not a valid regular expression (",
                  e.what(), ")");
    }
  }
  return out;
}

// Reads this rank's piece of every entry of `like`, in order, and hands each to `use` (key, the
// entry of `like`, the piece in `like`'s dtype) before reading the next. Every key is checked
// against the directory first: nothing is read when one is missing or unexpected (a tensor
// of the files skipped by options.ignore_unexpected() is neither).
template <typename Use>
void for_each_piece(const std::string& dir, const ShardedStateDict& like, const SafetensorsOptions& options, Use use) {
  const std::vector<std::regex> skip = compiled(options.ignore_unexpected());  // refused before any file is read
  const std::map<std::string, std::string> files = weight_map_of(dir, options.prefix());
  const std::map<std::string, std::string> file_name = file_names_of(like, files, options.optional_key_prefix());
  for (const auto& item : like) {
    const std::string& name = file_name.at(item.key());
    TORCH_CHECK(files.count(name), "fsdp::load_safetensors: '", dir, "' has no tensor '", name, "' (the model has it",
                name == item.key() ? std::string() : " as '" + item.key() + "'", ")");
  }
  std::set<std::string> wanted;
  for (const auto& item : file_name) wanted.insert(item.second);
  for (const auto& item : files) {
    TORCH_CHECK(wanted.count(item.first) || ignored(item.first, skip), "fsdp::load_safetensors: '", dir,
                "' has tensor '", item.first, "', which the model has not (unexpected key)");
  }
  // Each file opened once and its header checked once, in the order the model needs them.
  struct OpenFile {
    FilePtr f{nullptr, std::fclose};
    FileIndex index;
  };
  std::map<std::string, OpenFile> open;
  for (const auto& item : like) {
    const std::string& name = file_name.at(item.key());
    const std::string path = (std::filesystem::path(dir) / files.at(name)).string();
    auto it = open.find(path);
    if (it == open.end()) {
      OpenFile o;
      o.f.reset(std::fopen(path.c_str(), "rb"));
      TORCH_CHECK(o.f, "fsdp::load_safetensors: cannot open '", path, "': ", std::strerror(errno));
      o.index = index_file(path, o.f.get());
      it = open.emplace(path, std::move(o)).first;
    }
    const auto entry = it->second.index.entries.find(name);
    TORCH_CHECK(entry != it->second.index.entries.end(), "fsdp::load_safetensors: the index of '", dir, "' puts '",
                name, "' in '", path, "', which does not hold it");
    use(item.key(), item.value(),
        read_local_rows(path, it->second.f.get(), it->second.index, entry->second, item.value(),
                        options.convert_float_dtypes()));
  }
}

}  // namespace

ShardedStateDict load_safetensors(const std::string& dir, const ShardedStateDict& like,
                                  const SafetensorsOptions& options) {
  ShardedStateDict out;
  for_each_piece(dir, like, options, [&](const std::string& key, const DTensor& target, at::Tensor local) {
    out.insert(key, DTensor::from_local(std::move(local), target.device_mesh(), target.placements(), target.sizes()));
  });
  return out;
}

void load_safetensors_into(const std::string& dir, const ShardedStateDict& targets, const SafetensorsOptions& options) {
  at::NoGradGuard no_grad;
  for_each_piece(dir, targets, options, [&](const std::string&, const DTensor& target, const at::Tensor& local) {
    at::Tensor live = target.to_local();
    live.copy_(local.to(live.device()));
  });
}

TensorStateDict load_safetensors_file(const std::string& path) {
  FilePtr f(std::fopen(path.c_str(), "rb"), std::fclose);
  TORCH_CHECK(f, "fsdp::load_safetensors_file: cannot open '", path, "': ", std::strerror(errno));
  const long end = std::fseek(f.get(), 0, SEEK_END) == 0 ? std::ftell(f.get()) : -1;
  TORCH_CHECK(end >= 0, "fsdp::load_safetensors_file: cannot seek in '", path, "' (not a regular file?)");
  const auto file_size = static_cast<uint64_t>(end);
  std::rewind(f.get());
  uint64_t data_size = 0;
  const char* api = "fsdp::load_safetensors_file";
  const Json header = read_header(path, f.get(), file_size, &data_size, api);

  std::vector<Entry> entries;
  for (const auto& item : header.items()) {
    if (item.key() == "__metadata__") {
      const Json& m = item.value();
      TORCH_CHECK(m.is_object() && std::all_of(m.begin(), m.end(), [](const Json& v) { return v.is_string(); }),
                  "fsdp::load_safetensors_file: '", path, "': __metadata__ is not an object of strings");
      continue;
    }
    entries.push_back(parse_entry(path, item.key(), item.value(), data_size, api));
  }
  check_tiling(path, entries, data_size, api);

  // The entries now tile the data in file order, so one sequential pass reads them all.
  TensorStateDict out;
  for (const Entry& e : entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
    TORCH_CHECK(std::fread(t.data_ptr(), 1, t.nbytes(), f.get()) == t.nbytes(), "fsdp::load_safetensors_file: '", path,
                "': reading tensor '", e.name, "' failed");
    out.insert(e.name, std::move(t));
  }
  return out;
}

}  // namespace fsdp
