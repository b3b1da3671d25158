// Distributed checkpoints: the data files, the metadata (written last), and reading back only
// the byte ranges this rank's pieces need.
#include <fsdp/checkpoint.h>

#include "src/checkpoint/state_dict_pieces.h"

#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <optional>

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kMetadataFile = "metadata.json";
constexpr const char* kFormatName = "fsdp-cpp distributed checkpoint";
constexpr int64_t kBlockBytes = int64_t{1} << 20;  // checksum granularity

std::string data_file_name(int rank) { return "rank_" + std::to_string(rank) + ".data"; }

uint32_t crc_of(const char* data, int64_t n) {
  return static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(data), static_cast<uInt>(n)));
}

// Writes `bytes` to `path` durably: temporary name, fsync, rename.
void write_file_durably(const fs::path& path, const char* bytes, size_t n) {
  const fs::path tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "fsdp checkpoint: cannot create '", tmp.string(), "': ", std::strerror(errno));
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::write(fd, bytes + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ::close(fd);
      TORCH_CHECK(false, "fsdp checkpoint: writing '", tmp.string(), "' failed: ", std::strerror(errno));
    }
    done += static_cast<size_t>(w);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  TORCH_CHECK(synced, "fsdp checkpoint: fsync of '", tmp.string(), "' failed: ", std::strerror(errno));
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TORCH_CHECK(!ec, "fsdp checkpoint: renaming '", tmp.string(), "' to '", path.string(), "' failed: ", ec.message());
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Everyone's bytes, in rank order (rank 0 uses them; every rank takes part).
std::vector<std::string> gather_strings(ProcessGroup& group, const std::string& mine) {
  at::Tensor sizes = at::empty({group.size()}, at::kLong);
  group.all_gather_into(sizes, at::full({1}, static_cast<int64_t>(mine.size()), at::kLong))->wait();
  std::vector<int64_t> counts(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + group.size());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  at::Tensor all = at::empty({total}, at::kByte);
  at::Tensor in = at::empty({static_cast<int64_t>(mine.size())}, at::kByte);
  std::memcpy(in.data_ptr(), mine.data(), mine.size());
  group.all_gather_v(all, in, counts)->wait();
  std::vector<std::string> out;
  const char* p = static_cast<const char*>(all.data_ptr());
  for (int64_t c : counts) {
    out.emplace_back(p, c);
    p += c;
  }
  return out;
}

// ------------------------------------------------------------------------------ reading

struct Chunk {
  std::vector<int64_t> offsets, sizes;
  std::string file;
  int64_t byte_offset = 0, byte_length = 0;
  std::vector<uint32_t> crc32;
};

// The parsed metadata.json of `dir`, checked for format and version. Its other fields are read
// (and may throw json::exception) by the caller.
json read_metadata(const fs::path& dir) {
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(dir, ec), "fsdp::load_checkpoint: checkpoint directory '", dir.string(),
              "' does not exist", ec ? " (" + ec.message() + ")" : std::string());
  const fs::path meta = dir / kMetadataFile;
  TORCH_CHECK(fs::exists(meta, ec), "fsdp::load_checkpoint: '", meta.string(), "' is missing: '", dir.string(),
              "' is not a complete checkpoint (its save did not finish)");
  std::ifstream f(meta);
  json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "fsdp::load_checkpoint: '", meta.string(), "' is not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.value("format", "") == kFormatName, "fsdp::load_checkpoint: '", meta.string(),
              "' is not an fsdp-cpp checkpoint metadata file");
  const int version = j.value("version", 0);
  TORCH_CHECK(version >= 1 && version <= kCheckpointFormatVersion, "fsdp::load_checkpoint: '", meta.string(),
              "' has format version ", version, "; this build reads versions 1 to ", kCheckpointFormatVersion,
              " (written by a newer fsdp-cpp?)");
  return j;
}

// Reads rows [row_begin, row_end) of `chunk` (or all of it) and checks the CRC of every
// 1 MiB block touched. Returns the chunk's bytes from the first block touched, and where the
// requested range starts in them.
std::string read_chunk_range(const fs::path& dir, const std::string& key, const Chunk& c, int64_t begin,
                             int64_t end, int64_t* skip) {
  const int64_t first_block = begin / kBlockBytes;
  const int64_t last_block = (end + kBlockBytes - 1) / kBlockBytes;  // exclusive
  const int64_t from = first_block * kBlockBytes;
  const int64_t to = std::min(c.byte_length, last_block * kBlockBytes);
  const fs::path path = dir / c.file;
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f, "fsdp::load_checkpoint: data file '", path.string(), "' (key '", key, "') cannot be opened");
  std::string bytes(static_cast<size_t>(to - from), '\0');
  f.seekg(c.byte_offset + from);
  f.read(&bytes[0], to - from);
  TORCH_CHECK(f.gcount() == to - from, "fsdp::load_checkpoint: data file '", path.string(), "' is truncated (key '",
              key, "' needs bytes up to ", c.byte_offset + to, ")");
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t lo = b * kBlockBytes - from, hi = std::min(to, (b + 1) * kBlockBytes) - from;
    TORCH_CHECK(b < static_cast<int64_t>(c.crc32.size()) && crc_of(bytes.data() + lo, hi - lo) == c.crc32[b],
                "fsdp::load_checkpoint: checksum mismatch in '", path.string(), "' (key '", key, "', block ", b,
                "): the file is corrupted");
  }
  *skip = begin - from;
  return bytes;
}

// The chunk record of the metadata, as read back.
Chunk chunk_of(const json& c) {
  return Chunk{c.at("offsets").get<std::vector<int64_t>>(), c.at("sizes").get<std::vector<int64_t>>(),
               c.at("file").get<std::string>(),             c.at("byte_offset").get<int64_t>(),
               c.at("byte_length").get<int64_t>(),          c.at("crc32").get<std::vector<uint32_t>>()};
}

// Checks every data file's size against the metadata, naming a key whose bytes the damage reaches.
void check_data_files(const fs::path& dir, const json& meta, const std::string& meta_path) {
  const json& entries = meta.at("entries");
  for (const auto& f : meta.at("files").items()) {
    const fs::path path = dir / f.key();
    std::error_code ec;
    const auto bytes = fs::file_size(path, ec);
    const int64_t size = ec ? -1 : static_cast<int64_t>(bytes);
    if (size == f.value().get<int64_t>()) continue;
    std::string key = "?";
    for (const auto& e : entries.items()) {
      for (const auto& c : e.value().at("chunks")) {
        if (c.at("file") == f.key() && c.at("byte_offset").get<int64_t>() + c.at("byte_length").get<int64_t>() > size) {
          key = e.key();
          break;
        }
      }
      if (key != "?") break;
    }
    TORCH_CHECK(size >= 0, "fsdp::load_checkpoint: data file '", path.string(), "' listed in '", meta_path,
                "' is missing (it holds key '", key, "')");
    TORCH_CHECK(false, "fsdp::load_checkpoint: data file '", path.string(), "' is truncated or overwritten: ", size,
                " bytes, '", meta_path, "' says ", f.value().get<int64_t>(), " (key '", key, "' is affected)");
  }
}

// Checks that the checkpoint holds exactly the keys of `like`, with their shapes and dtypes.
void check_keys(const json& entries, const ShardedStateDict& like, const std::string& meta_path) {
  for (const auto& item : like) {
    TORCH_CHECK(entries.contains(item.key()), "fsdp::load_checkpoint: missing key '", item.key(), "' in '", meta_path, "'");
    const json& e = entries.at(item.key());
    TORCH_CHECK(e.at("shape").get<std::vector<int64_t>>() == item.value().sizes(), "fsdp::load_checkpoint: key '",
                item.key(), "' has shape ", e.at("shape").dump(), " in '", meta_path, "' but ",
                c10::IntArrayRef(item.value().sizes()), " here");
    TORCH_CHECK(e.at("dtype").get<std::string>() == c10::toString(item.value().scalar_type()),
                "fsdp::load_checkpoint: key '", item.key(), "' has dtype ", e.at("dtype").get<std::string>(), " in '",
                meta_path, "' but ", item.value().scalar_type(), " here");
  }
  for (const auto& kv : entries.items()) {
    TORCH_CHECK(like.find(kv.key()), "fsdp::load_checkpoint: unexpected key '", kv.key(), "' in '", meta_path,
                "' (the state dict to load into has no such entry)");
  }
}

// This rank's piece of `target`, read from the chunks of `entry` that overlap it.
at::Tensor read_piece(const fs::path& dir, const std::string& key, const json& entry, const DTensor& target) {
  const auto want = target.local_bounds();
  at::Tensor local = at::empty(target.to_local().sizes(), target.to_local().options());
  const int64_t row_bytes = local.dim() == 0 ? local.element_size()
                                             : (local.size(0) > 0 ? local.numel() / local.size(0) : 0) * local.element_size();
  for (const auto& cj : entry.at("chunks")) {
    const Chunk c = chunk_of(cj);
    int64_t chunk_numel = 1;
    for (int64_t s : c.sizes) chunk_numel *= s;
    TORCH_CHECK(c.offsets.size() == want.size() && c.sizes.size() == want.size() &&
                    c.byte_length == chunk_numel * static_cast<int64_t>(local.element_size()),
                "fsdp::load_checkpoint: key '", key, "' has a chunk whose offsets, sizes or byte length do not fit "
                "its shape; the metadata is damaged: load an earlier checkpoint");
    if (local.dim() == 0) {  // a scalar: one chunk holds it
      int64_t skip = 0;
      const std::string bytes = read_chunk_range(dir, key, c, 0, c.byte_length, &skip);
      std::memcpy(local.data_ptr(), bytes.data() + skip, local.element_size());
      continue;
    }
    // Chunks and pieces are split along dim 0 only and span every other dim whole.
    for (size_t d = 1; d < want.size(); ++d) {
      TORCH_CHECK(c.offsets[d] == 0 && c.sizes[d] == want[d].length && want[d].offset == 0, "fsdp::load_checkpoint: "
                  "key '", key, "' was saved split along a dim other than 0; not supported yet");
    }
    const int64_t lo = std::max(c.offsets[0], want[0].offset);
    const int64_t hi = std::min(c.offsets[0] + c.sizes[0], want[0].offset + want[0].length);
    if (lo >= hi) continue;
    int64_t skip = 0;
    const std::string bytes =
        read_chunk_range(dir, key, c, (lo - c.offsets[0]) * row_bytes, (hi - c.offsets[0]) * row_bytes, &skip);
    std::memcpy(static_cast<char*>(local.data_ptr()) + (lo - want[0].offset) * row_bytes, bytes.data() + skip,
                static_cast<size_t>((hi - lo) * row_bytes));
  }
  return local;
}

// ------------------------------------------------------------------------------ writing

// Runs `local_work` on every rank of `world`, then makes all ranks agree: if it threw anywhere,
// every rank throws, naming each failed rank and its error (so nobody is left waiting in a
// collective). Collective; also acts as a barrier. Returns every rank's result string, in rank
// order.
std::vector<std::string> on_all_ranks(ProcessGroup& world, const char* phase,
                                      const std::function<std::string()>& local_work) {
  json mine;
  try {
    mine["result"] = local_work();
  } catch (const std::exception& e) {
    mine["error"] = e.what();
  }
  std::vector<std::string> results, errors;
  // An error message may quote a path that is not UTF-8: replace such bytes rather than fail.
  const std::vector<std::string> all = gather_strings(world, mine.dump(-1, ' ', false, json::error_handler_t::replace));
  for (size_t r = 0; r < all.size(); ++r) {
    const json j = json::parse(all[r]);
    if (j.contains("error")) errors.push_back("rank " + std::to_string(r) + ": " + j.at("error").get<std::string>());
    else results.push_back(j.at("result").get<std::string>());
  }
  if (!errors.empty()) {
    std::string msg;
    for (const auto& e : errors) msg += (msg.empty() ? "" : "; ") + e;
    TORCH_CHECK(false, "fsdp::save_checkpoint failed while ", phase, ": ", msg);
  }
  return results;
}

// This rank's pieces, one after another (its data file), and their chunk records.
std::string pack_pieces(const ShardedStateDict& state_dict, int rank, json* chunks) {
  std::string data;
  for (const auto& item : state_dict) {
    const DTensor& d = item.value();
    const std::vector<int64_t> coord = d.device_mesh().coordinate();
    const bool writer = !detail::all_replicate(d.placements()) ||
                        std::all_of(coord.begin(), coord.end(), [](int64_t c) { return c == 0; });
    at::Tensor local = d.to_local().contiguous();
    if (!writer || local.numel() == 0) continue;  // replicated values are written once
    json c = {{"offsets", json::array()}, {"sizes", json::array()}, {"crc32", json::array()}};
    for (const auto& b : d.local_bounds()) {
      c["offsets"].push_back(b.offset);
      c["sizes"].push_back(b.length);
    }
    const int64_t n = local.numel() * local.element_size();
    c["file"] = data_file_name(rank);
    c["byte_offset"] = static_cast<int64_t>(data.size());
    c["byte_length"] = n;
    const char* bytes = static_cast<const char*>(local.data_ptr());
    for (int64_t at = 0; at < n; at += kBlockBytes) c["crc32"].push_back(crc_of(bytes + at, std::min(kBlockBytes, n - at)));
    data.append(bytes, static_cast<size_t>(n));
    (*chunks)[item.key()] = c;
  }
  return data;
}

// The metadata file's content, from every rank's report ({"file_bytes", "chunks"}).
std::string make_metadata(const ShardedStateDict& state_dict, const std::vector<std::string>& reports) {
  json entries = json::object();
  for (const auto& item : state_dict) {
    entries[item.key()] = {{"dtype", std::string(c10::toString(item.value().scalar_type()))},
                           {"shape", item.value().sizes()},
                           {"chunks", json::array()}};
  }
  json files = json::object();
  for (size_t r = 0; r < reports.size(); ++r) {
    const json report = json::parse(reports[r]);  // named: items() would dangle on a temporary
    files[data_file_name(static_cast<int>(r))] = report.at("file_bytes");
    for (const auto& kv : report.at("chunks").items()) entries[kv.key()]["chunks"].push_back(kv.value());
  }
  json meta = {{"format", kFormatName}, {"version", kCheckpointFormatVersion}, {"world_size", reports.size()},
               {"block_bytes", kBlockBytes}};
  meta["files"] = files;  // name -> size: a truncated file is caught without reading it
  meta["entries"] = entries;
  return meta.dump(1);
}

// The save itself, over `world` (all ranks; the world group, or the background saver's own).
// Every phase ends with all ranks agreeing it succeeded, so an error on one rank (a full disk,
// a path that is a file) fails the save on every rank at once instead of leaving them waiting.
void write_checkpoint(const std::string& dir_name, const ShardedStateDict& state_dict,
                      const std::shared_ptr<ProcessGroup>& world) {
  const fs::path dir(dir_name);
  const int rank = world->rank();
  on_all_ranks(*world, "preparing the directory", [&] {
    if (rank == 0) {
      fs::create_directories(dir);
      fs::remove(dir / kMetadataFile);  // the old checkpoint there stops being loadable first
    }
    return std::string();
  });
  const std::vector<std::string> reports = on_all_ranks(*world, "writing the data files", [&] {
    json chunks = json::object();
    const std::string data = pack_pieces(state_dict, rank, &chunks);
    write_file_durably(dir / data_file_name(rank), data.data(), data.size());
    return json{{"file_bytes", static_cast<int64_t>(data.size())}, {"chunks", chunks}}.dump();
  });
  // Rank 0 writes the metadata last: only now is the checkpoint complete.
  on_all_ranks(*world, "writing the metadata", [&] {
    if (rank == 0) {
      const std::string meta = make_metadata(state_dict, reports);
      write_file_durably(dir / kMetadataFile, meta.data(), meta.size());
      fsync_dir(dir);
    }
    return std::string();
  });
}

// N for a name that is exactly step_<N> (N an integer, as save() writes it); nothing otherwise.
std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return std::nullopt;
  const char* number = name.c_str() + 5;
  const char* first_digit = number + (*number == '-' ? 1 : 0);
  if (*first_digit < '0' || *first_digit > '9') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long step = std::strtoll(number, &end, 10);
  if (*end != '\0' || errno != 0) return std::nullopt;
  return static_cast<int64_t>(step);
}

// Points root/latest at `dir` and keeps the newest `keep` step directories (rank 0 only).
// Directories whose names are not exactly step_<N> are not the manager's and are left alone.
void commit_latest(const fs::path& root, const fs::path& dir, int keep) {
  const std::string name = dir.filename().string();
  write_file_durably(root / "latest", name.data(), name.size());
  fsync_dir(root);
  if (keep <= 0) return;
  std::vector<std::pair<int64_t, fs::path>> steps;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    const std::optional<int64_t> step = parse_step_dir_name(it->path().filename().string());
    if (step && it->is_directory(type_ec)) steps.emplace_back(*step, it->path());
  }
  TORCH_CHECK(!ec, "fsdp::CheckpointManager: cannot list '", root.string(), "' to prune old checkpoints: ",
              ec.message());
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + keep < steps.size(); ++i) {
    if (steps[i].second == dir) continue;
    fs::remove_all(steps[i].second, ec);
    TORCH_CHECK(!ec, "fsdp::CheckpointManager: cannot remove the old checkpoint '", steps[i].second.string(), "': ",
                ec.message(), "; fix its permissions or remove it by hand");
  }
}

// A copy of every local piece in fresh memory, with the same layout.
ShardedStateDict staged_copy(const ShardedStateDict& state_dict) {
  ShardedStateDict out;
  for (const auto& item : state_dict) {
    const DTensor& d = item.value();
    out.insert(item.key(), DTensor::from_local(d.to_local().detach().clone(at::MemoryFormat::Contiguous),
                                               d.device_mesh(), d.placements(), d.sizes()));
  }
  return out;
}

}  // namespace

void save_checkpoint(const std::string& dir, const ShardedStateDict& state_dict) {
  write_checkpoint(dir, state_dict, fsdp::world());
}

ShardedStateDict load_checkpoint(const std::string& dir_name, const ShardedStateDict& like) {
  const fs::path dir(dir_name);
  const std::string meta_path = (dir / kMetadataFile).string();
  try {
    const json meta = read_metadata(dir);
    check_data_files(dir, meta, meta_path);
    const json& entries = meta.at("entries");
    check_keys(entries, like, meta_path);
    ShardedStateDict out;
    for (const auto& item : like) {
      const DTensor& target = item.value();
      at::Tensor local = read_piece(dir, item.key(), entries.at(item.key()), target);
      out.insert(item.key(), DTensor::from_local(local, target.device_mesh(), target.placements(), target.sizes()));
    }
    return out;
  } catch (const json::exception& e) {  // a field missing or of the wrong type
    TORCH_CHECK(false, "fsdp::load_checkpoint: '", meta_path, "' is damaged: ", e.what(),
                "; load an earlier checkpoint");
  }
}

// ------------------------------------------------------------------------------ manager

// The background saver: its own process group (so its collectives never interleave with the
// training's), and the write in flight.
struct CheckpointManager::Background {
  std::shared_ptr<ProcessGroup> group;
  std::future<void> pending;
};

CheckpointManager::CheckpointManager(std::string root, int keep)
    : root_(std::move(root)), keep_(keep), background_(std::make_unique<Background>()) {}

CheckpointManager::~CheckpointManager() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp::CheckpointManager: the background save under '%s' failed: %s\n", root_.c_str(), e.what());
  }
}

void CheckpointManager::wait() {
  if (background_->pending.valid()) background_->pending.get();  // rethrows the save's error
}

std::string CheckpointManager::save(int64_t step, const ShardedStateDict& state_dict) {
  wait();
  const fs::path dir = fs::path(root_) / ("step_" + std::to_string(step));
  save_checkpoint(dir.string(), state_dict);
  if (fsdp::get_rank() == 0) commit_latest(root_, dir, keep_);
  fsdp::world()->barrier()->wait();
  return dir.string();
}

void CheckpointManager::save_async(int64_t step, const ShardedStateDict& state_dict) {
  wait();
  if (!background_->group) {
    std::vector<int> all(fsdp::get_world_size());
    for (size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
    background_->group = fsdp::new_group(all);
  }
  ShardedStateDict staged = staged_copy(state_dict);
  const fs::path dir = fs::path(root_) / ("step_" + std::to_string(step));
  const fs::path root(root_);
  const int keep = keep_;
  auto group = background_->group;
  background_->pending = std::async(std::launch::async, [dir, root, keep, group, staged = std::move(staged)] {
    write_checkpoint(dir.string(), staged, group);
    if (group->rank() == 0) commit_latest(root, dir, keep);
    group->barrier()->wait();
  });
}

std::optional<std::string> CheckpointManager::latest() const {
  std::ifstream f(fs::path(root_) / "latest");
  std::string name;
  if (!f || !(f >> name)) return std::nullopt;
  const fs::path dir = fs::path(root_) / name;
  std::error_code ec;
  if (!fs::exists(dir / kMetadataFile, ec)) return std::nullopt;
  return dir.string();
}

int64_t CheckpointManager::step_of(const std::string& dir) {
  const std::optional<int64_t> step = parse_step_dir_name(fs::path(dir).filename().string());
  TORCH_CHECK(step, "fsdp::CheckpointManager: '", dir, "' is not a step_<N> directory (N an integer); move anything "
              "else named step_* out of the checkpoint root");
  return *step;
}

}  // namespace fsdp
