// Distributed checkpoints: the data files, the metadata (written last), and reading back only
// the byte ranges this rank's pieces need.
#include <fsdp/checkpoint.h>

#include "src/checkpoint/checkpoint_metadata.h"
#include "src/checkpoint/checkpoint_write.h"
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
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::kCheckpointBlockBytes;
using detail::kMetadataFile;

uint32_t crc_of(const char* data, int64_t n) {
  return static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(data), static_cast<uInt>(n)));
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
// Everything below runs on metadata that read_checkpoint_metadata has checked in full, and
// after check_data_files: every byte range read lies inside a data file of the recorded size.

// Reads bytes [begin, end) of chunk `c` (relative to its start) and checks the CRC of every
// block touched. Returns the chunk's bytes from the first block touched, and where the
// requested range starts in them.
std::string read_chunk_range(const fs::path& dir, const std::string& key, const detail::ChunkRecord& c, int64_t begin,
                             int64_t end, int64_t* skip) {
  const int64_t first_block = begin / kCheckpointBlockBytes;
  const int64_t last_block = (end + kCheckpointBlockBytes - 1) / kCheckpointBlockBytes;  // exclusive
  const int64_t from = first_block * kCheckpointBlockBytes;
  const int64_t to = std::min(c.byte_length, last_block * kCheckpointBlockBytes);
  const fs::path path = dir / c.file;
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f, "fsdp::load_checkpoint: data file '", path.string(), "' (key '", key, "') cannot be opened");
  std::string bytes(static_cast<size_t>(to - from), '\0');
  f.seekg(c.byte_offset + from);
  f.read(&bytes[0], to - from);
  TORCH_CHECK(f.gcount() == to - from, "fsdp::load_checkpoint: data file '", path.string(), "' is truncated (key '",
              key, "' needs bytes up to ", c.byte_offset + to, ")");
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t lo = b * kCheckpointBlockBytes - from, hi = std::min(to, (b + 1) * kCheckpointBlockBytes) - from;
    TORCH_CHECK(crc_of(bytes.data() + lo, hi - lo) == c.crc32[b], "fsdp::load_checkpoint: checksum mismatch in '",
                path.string(), "' (key '", key, "', block ", b, "): the file is corrupted");
  }
  *skip = begin - from;
  return bytes;
}

// Checks every data file against the metadata, naming a key whose bytes the damage reaches.
void check_data_files(const std::string& dir, const detail::CheckpointMetadata& meta) {
  const std::optional<detail::DataFileProblem> p = detail::find_data_file_problem(dir, meta);
  if (!p) return;
  std::string key = "?";
  for (const auto& [name, entry] : meta.entries) {
    for (const auto& c : entry.chunks) {
      if (key == "?" && c.file == p->file && (p->actual < 0 || c.byte_offset + c.byte_length > p->actual)) key = name;
    }
  }
  TORCH_CHECK(p->actual < 0, "fsdp::load_checkpoint: data file '", p->path,
              "' is truncated or overwritten: ", p->actual, " bytes, '", meta.path, "' says ", p->recorded, " (key '",
              key, "' is affected)");
  TORCH_CHECK(false, "fsdp::load_checkpoint: data file '", p->path, "' listed in '", meta.path, "' ", p->predicate,
              " (it holds key '", key, "')");
}

// Checks that the checkpoint holds exactly the keys of `like`, with their shapes and dtypes.
void check_keys(const detail::CheckpointMetadata& meta, const ShardedStateDict& like) {
  for (const auto& item : like) {
    const auto e = meta.entries.find(item.key());
    TORCH_CHECK(e != meta.entries.end(), "fsdp::load_checkpoint: missing key '", item.key(), "' in '", meta.path, "'");
    TORCH_CHECK(e->second.shape == item.value().sizes(), "fsdp::load_checkpoint: key '", item.key(), "' has shape ",
                c10::IntArrayRef(e->second.shape), " in '", meta.path, "' but ", c10::IntArrayRef(item.value().sizes()),
                " here");
    TORCH_CHECK(e->second.dtype == item.value().scalar_type(), "fsdp::load_checkpoint: key '", item.key(),
                "' has dtype ", e->second.dtype, " in '", meta.path, "' but ", item.value().scalar_type(), " here");
  }
  for (const auto& kv : meta.entries) {
    TORCH_CHECK(like.find(kv.first), "fsdp::load_checkpoint: unexpected key '", kv.first, "' in '", meta.path,
                "' (the state dict to load into has no such entry)");
  }
}

// Copies rows [lo, hi) of the global tensor from chunk `c`, whose first row is `chunk_row`, into
// `local`, whose first row is `local_row`. (A scalar is one row of one element.)
void copy_rows(const fs::path& dir, const std::string& key, const detail::ChunkRecord& c, int64_t chunk_row, int64_t lo,
               int64_t hi, int64_t local_row, int64_t row_bytes, at::Tensor& local) {
  int64_t skip = 0;
  const std::string bytes =
      read_chunk_range(dir, key, c, (lo - chunk_row) * row_bytes, (hi - chunk_row) * row_bytes, &skip);
  std::memcpy(static_cast<char*>(local.data_ptr()) + (lo - local_row) * row_bytes, bytes.data() + skip,
              static_cast<size_t>((hi - lo) * row_bytes));
}

// Copies the overlap of chunk `c` with `local` (the piece of the global tensor at `want`), when
// the two split the tensor along different dims: the chunk's rows in the overlap are read (they
// are contiguous in its bytes), then the overlap is cut out of them along the other dims.
void copy_box(const fs::path& dir, const std::string& key, const detail::ChunkRecord& c,
              const std::vector<ChunkBounds>& want, at::Tensor& local) {
  std::vector<int64_t> lo(want.size()), hi(want.size());
  for (size_t d = 0; d < want.size(); ++d) {
    lo[d] = std::max(c.offsets[d], want[d].offset);
    hi[d] = std::min(c.offsets[d] + c.sizes[d], want[d].offset + want[d].length);
    if (lo[d] >= hi[d]) return;  // no overlap
  }
  std::vector<int64_t> rows_shape = c.sizes;
  rows_shape[0] = hi[0] - lo[0];
  int64_t row_bytes = local.element_size();
  for (size_t d = 1; d < c.sizes.size(); ++d) row_bytes *= c.sizes[d];
  int64_t skip = 0;
  std::string bytes =
      read_chunk_range(dir, key, c, (lo[0] - c.offsets[0]) * row_bytes, (hi[0] - c.offsets[0]) * row_bytes, &skip);
  at::Tensor src = at::from_blob(&bytes[skip], rows_shape, local.options());
  at::Tensor dst = local.narrow(0, lo[0] - want[0].offset, hi[0] - lo[0]);
  for (size_t d = 1; d < want.size(); ++d) {
    src = src.narrow(d, lo[d] - c.offsets[d], hi[d] - lo[d]);
    dst = dst.narrow(d, lo[d] - want[d].offset, hi[d] - lo[d]);
  }
  dst.copy_(src);
}

// Whether the box at `offsets` of `sizes` spans every dim but dim 0 of `shape` whole.
bool split_along_rows_only(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                           const std::vector<int64_t>& shape) {
  for (size_t d = 1; d < shape.size(); ++d) {
    if (offsets[d] != 0 || sizes[d] != shape[d]) return false;
  }
  return true;
}

// This rank's piece of `target`, read from the chunks of `entry` that overlap it. The chunks
// tile the global shape (checked), so every byte of the piece is read exactly once. Chunk and
// piece may split the tensor along different dims (a checkpoint of Shard(1) parameters loaded
// into Shard(0) ones): then only the overlap of each chunk's rows is kept.
at::Tensor read_piece(const fs::path& dir, const std::string& key, const detail::EntryRecord& entry,
                      const DTensor& target) {
  const auto want = target.local_bounds();
  // Read into host memory; the caller moves the piece to the target's device.
  at::Tensor local = at::empty(target.to_local().sizes(), target.to_local().options().device(at::kCPU));
  if (local.numel() == 0) return local;
  if (local.dim() == 0) {  // a scalar: its one chunk holds it
    copy_rows(dir, key, entry.chunks.at(0), 0, 0, 1, 0, local.element_size(), local);
    return local;
  }
  std::vector<int64_t> want_offsets, want_sizes;
  for (const auto& b : want) {
    want_offsets.push_back(b.offset);
    want_sizes.push_back(b.length);
  }
  const bool rows_only = split_along_rows_only(want_offsets, want_sizes, entry.shape);
  const int64_t row_bytes = local.numel() / local.size(0) * local.element_size();
  for (const auto& c : entry.chunks) {
    if (!rows_only || !split_along_rows_only(c.offsets, c.sizes, entry.shape)) {
      copy_box(dir, key, c, want, local);
      continue;
    }
    // Both whole rows: one contiguous copy of the rows they share.
    const int64_t lo = std::max(c.offsets[0], want[0].offset);
    const int64_t hi = std::min(c.offsets[0] + c.sizes[0], want[0].offset + want[0].length);
    if (lo < hi) copy_rows(dir, key, c, c.offsets[0], lo, hi, want[0].offset, row_bytes, local);
  }
  return local;
}

// ------------------------------------------------------------------------------ writing

// An error message on one line (a rank's line in the agreed error).
std::string one_line(std::string message) {
  std::replace(message.begin(), message.end(), '\n', ' ');
  return message;
}

}  // namespace

namespace detail {

std::vector<std::string> on_all_ranks(ProcessGroup& world, const char* who, const char* phase,
                                      const std::function<std::string()>& local_work) {
  json mine;
  try {
    mine["result"] = local_work();
  } catch (const c10::Error& e) {
    mine["error"] = one_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    mine["error"] = one_line(e.what());
  }
  std::vector<std::string> results;
  std::string errors;
  // An error message may quote a path that is not UTF-8: replace such bytes rather than fail.
  const std::vector<std::string> all = gather_strings(world, mine.dump(-1, ' ', false, json::error_handler_t::replace));
  for (size_t r = 0; r < all.size(); ++r) {
    const json j = json::parse(all[r]);
    if (j.contains("error")) errors += "\n  rank " + std::to_string(r) + ": " + j.at("error").get<std::string>();
    else results.push_back(j.at("result").get<std::string>());
  }
  TORCH_CHECK(errors.empty(), who, " failed while ", phase, ":", errors);
  return results;
}

bool writes_piece(const DTensor& d) {
  const std::vector<int64_t> coord = d.device_mesh().coordinate();
  const std::vector<Placement> placements = d.placements();
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_replicate() && coord[i] != 0) return false;
  }
  return true;
}

}  // namespace detail

namespace {

// Writes this rank's pieces, one after another, as its data file `path`, and returns their
// chunk records and the file's size. Each piece goes to the file as it is read (a device's
// piece through its host copy, one at a time): the file is never assembled in memory, which at
// a real size would hold a second copy of the rank's parameters and optimizer state (and up to
// twice that while a growing buffer is reallocated) beside the live ones.
json write_pieces(const ShardedStateDict& state_dict, int rank, const fs::path& path) {
  json chunks = json::object();
  int64_t file_bytes = 0;
  detail::write_file_durably(path, [&](const detail::AppendBytes& append) {
    for (const auto& item : state_dict) {
      const DTensor& d = item.value();
      if (!detail::writes_piece(d) || d.to_local().numel() == 0) continue;  // each piece is written once
      const at::Tensor local = d.to_local().to(at::kCPU).contiguous();      // a device's piece: its host copy
      json c = {{"offsets", json::array()}, {"sizes", json::array()}, {"crc32", json::array()}};
      for (const auto& b : d.local_bounds()) {
        c["offsets"].push_back(b.offset);
        c["sizes"].push_back(b.length);
      }
      const int64_t n = local.numel() * local.element_size();
      c["file"] = detail::data_file_name(rank);
      c["byte_offset"] = file_bytes;
      c["byte_length"] = n;
      const char* bytes = static_cast<const char*>(local.data_ptr());
      for (int64_t at = 0; at < n; at += kCheckpointBlockBytes) {
        c["crc32"].push_back(crc_of(bytes + at, std::min(kCheckpointBlockBytes, n - at)));
      }
      append(bytes, static_cast<size_t>(n));
      file_bytes += n;
      chunks[item.key()] = c;
    }
  });
  return json{{"file_bytes", file_bytes}, {"chunks", chunks}};
}

// The metadata file's content, from every rank's report ({"file_bytes", "chunks"}).
std::string make_metadata(const ShardedStateDict& state_dict, const std::vector<std::string>& reports,
                          const std::map<std::string, std::string>& attributes) {
  json entries = json::object();
  for (const auto& item : state_dict) {
    entries[item.key()] = {{"dtype", std::string(c10::toString(item.value().scalar_type()))},
                           {"shape", item.value().sizes()},
                           {"chunks", json::array()}};
  }
  json files = json::object();
  for (size_t r = 0; r < reports.size(); ++r) {
    const json report = json::parse(reports[r]);  // named: items() would dangle on a temporary
    files[detail::data_file_name(static_cast<int64_t>(r))] = report.at("file_bytes");
    for (const auto& kv : report.at("chunks").items()) entries[kv.key()]["chunks"].push_back(kv.value());
  }
  json meta = {{"format", detail::kCheckpointFormatName},
               {"version", kCheckpointFormatVersion},
               {"world_size", reports.size()},
               {"block_bytes", kCheckpointBlockBytes}};
  meta["files"] = files;  // name -> size: a truncated file is caught without reading it
  meta["entries"] = entries;
  // Written inside the metadata, so that a checkpoint is complete with its attributes or not at all.
  if (!attributes.empty()) meta["attributes"] = attributes;
  return meta.dump(1);
}

// Writes all of `bytes` to `fd`. Returns 0, or the errno of the failure (ENOSPC for a write
// that made no progress).
int write_all(int fd, const char* bytes, size_t n) {
  for (size_t done = 0; done < n;) {
    const ssize_t w = ::write(fd, bytes + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return w < 0 ? errno : ENOSPC;
    done += static_cast<size_t>(w);
  }
  return 0;
}

// Removes the temporary files a save killed midway left in `dir` (ours only: <name>.tmp for
// metadata.json and the rank_<r>.data names, parsed as the metadata reader parses them).
void remove_stale_temporaries(const fs::path& dir) {
  const std::string tmp = ".tmp";
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= tmp.size() || name.compare(name.size() - tmp.size(), tmp.size(), tmp) != 0) continue;
    const std::string target = name.substr(0, name.size() - tmp.size());
    const bool ours = target == kMetadataFile || detail::rank_of_data_file(target) >= 0;
    std::error_code remove_ec;
    if (ours) fs::remove(it->path(), remove_ec);
  }
}

}  // namespace

namespace detail {

void write_file_durably(const fs::path& path, const std::function<void(const AppendBytes&)>& write) {
  const fs::path tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create '", tmp.string(), "': ", std::strerror(errno));
  const char* step = "writing";
  int error = 0;
  try {
    write([&](const char* bytes, size_t n) {
      error = write_all(fd, bytes, n);
      TORCH_CHECK(!error, "writing '", tmp.string(), "' failed: ", std::strerror(error));
    });
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());  // a failed save leaves no temporary behind
    throw;
  }
  if (::fsync(fd) != 0) {
    step = "fsync of";
    error = errno;
  }
  ::close(fd);
  std::error_code ec;
  if (!error) fs::rename(tmp, path, ec);
  if (error || ec) ::unlink(tmp.c_str());
  TORCH_CHECK(!error, step, " '", tmp.string(), "' failed: ", std::strerror(error));
  TORCH_CHECK(!ec, "renaming '", tmp.string(), "' to '", path.string(), "' failed: ", ec.message());
}

void write_file_durably(const fs::path& path, const char* bytes, size_t n) {
  write_file_durably(path, [&](const AppendBytes& append) { append(bytes, n); });
}

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// Every phase ends with all ranks agreeing it succeeded, so an error on one rank (a full disk,
// a path that is a file) fails the save on every rank at once instead of leaving them waiting.
void write_checkpoint(const std::string& dir_name, const ShardedStateDict& state_dict,
                      const std::shared_ptr<ProcessGroup>& world, const std::function<void()>& commit,
                      const std::map<std::string, std::string>& attributes) {
  const fs::path dir(dir_name);
  const int rank = world->rank();
  detail::on_all_ranks(*world, "fsdp::save_checkpoint", "preparing the directory", [&] {
    if (rank == 0) {
      fs::create_directories(dir);
      fs::remove(dir / kMetadataFile);  // the old checkpoint there stops being loadable first
      remove_stale_temporaries(dir);
    }
    return std::string();
  });
  const std::vector<std::string> reports =
      detail::on_all_ranks(*world, "fsdp::save_checkpoint", "writing the data files",
                           [&] { return write_pieces(state_dict, rank, dir / detail::data_file_name(rank)).dump(); });
  // Rank 0 writes the metadata last: only now is the checkpoint complete.
  detail::on_all_ranks(*world, "fsdp::save_checkpoint", "writing the metadata", [&] {
    if (rank == 0) {
      const std::string meta = make_metadata(state_dict, reports, attributes);
      write_file_durably(dir / kMetadataFile, meta.data(), meta.size());
      fsync_dir(dir);
    }
    return std::string();
  });
  if (!commit) return;
  detail::on_all_ranks(*world, "fsdp::save_checkpoint", "pointing 'latest' at it and pruning old checkpoints", [&] {
    if (rank == 0) commit();
    return std::string();
  });
}

}  // namespace detail

void save_checkpoint(const std::string& dir, const ShardedStateDict& state_dict) {
  detail::write_checkpoint(dir, state_dict, fsdp::world());
}

ShardedStateDict load_checkpoint(const std::string& dir_name, const ShardedStateDict& like) {
  // Everything is checked before any data is read: the metadata in full, the data files' sizes,
  // and the keys, shapes and dtypes against `like`.
  const detail::CheckpointMetadata meta = detail::read_checkpoint_metadata(dir_name, "fsdp::load_checkpoint: ");
  check_data_files(dir_name, meta);
  check_keys(meta, like);
  try {
    ShardedStateDict out;
    for (const auto& item : like) {
      const DTensor& target = item.value();
      at::Tensor local =
          read_piece(dir_name, item.key(), meta.entries.at(item.key()), target).to(target.to_local().device());
      out.insert(item.key(), DTensor::from_local(local, target.device_mesh(), target.placements(), target.sizes()));
    }
    return out;
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {  // e.g. std::bad_alloc
    TORCH_CHECK(false, "fsdp::load_checkpoint: reading '", dir_name, "' failed: ", e.what());
  }
}

}  // namespace fsdp
