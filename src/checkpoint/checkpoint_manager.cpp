// CheckpointManager: numbered checkpoints under a root, the `latest` pointer and pruning (both
// inside the save's all-ranks agreement), the background saver, and the scan that tells a
// resuming run what the root holds. Only directories named exactly step_<N> are the manager's.
#include <fsdp/checkpoint.h>

#include "src/checkpoint/checkpoint_metadata.h"
#include "src/checkpoint/checkpoint_write.h"
#include "src/device/device_ops.h"

#include <fsdp/distributed.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using detail::kMetadataFile;

constexpr size_t kLatestMaxBytes = 4096;  // `latest` holds one directory name

// N for a name that is exactly step_<N>, N written as save() writes it; nothing otherwise.
std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  if (name.rfind("step_", 0) != 0 || name.size() > 30) return std::nullopt;
  const char* number = name.c_str() + 5;
  char* end = nullptr;
  errno = 0;
  const long long step = std::strtoll(number, &end, 10);
  if (end == number || errno != 0 || "step_" + std::to_string(step) != name) return std::nullopt;
  return static_cast<int64_t>(step);
}

struct StepDir {
  int64_t step;
  fs::path path;
};

// The step_<N> directories of `root`, by N ascending; `ec` tells whether the listing failed.
std::vector<StepDir> list_step_dirs(const fs::path& root, std::error_code& ec) {
  std::vector<StepDir> steps;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code type_ec;
    const std::optional<int64_t> step = parse_step_dir_name(it->path().filename().string());
    if (step && it->is_directory(type_ec)) steps.push_back({*step, it->path()});
  }
  std::sort(steps.begin(), steps.end(), [](const StepDir& a, const StepDir& b) { return a.step < b.step; });
  return steps;
}

// Why `dir` is not a complete checkpoint, as words to follow its path ("has no metadata.json
// (an incomplete save)"); nullopt when it is complete. Reads only the metadata and the data
// files' sizes. Never throws for a bad `dir`.
std::optional<std::string> incompleteness(const fs::path& dir) {
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);
  if (!fs::exists(status)) return std::string("does not exist");
  if (!fs::is_directory(status)) return std::string("is not a directory");
  if (!fs::exists(dir / kMetadataFile, ec)) return std::string("has no ") + kMetadataFile + " (an incomplete save)";
  try {
    const detail::CheckpointMetadata meta = detail::read_checkpoint_metadata(dir.string(), "");
    const std::optional<detail::DataFileProblem> p = detail::find_data_file_problem(dir.string(), meta);
    if (p) return "is incomplete: " + p->path + " " + p->predicate;
  } catch (const c10::Error& e) {
    return "cannot be loaded: " + std::string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return "cannot be checked: " + std::string(e.what());
  }
  return std::nullopt;
}

// Keeps the `keep` complete checkpoints with the largest steps, and `dir` (just saved, named by
// `latest`) whatever its step. Removes the other complete ones, and the incomplete ones older
// than the oldest kept (left by failed or killed saves); an incomplete one newer than that is
// left alone, and so is a DCP checkpoint (a .metadata, no metadata.json). Incomplete ones never
// count toward `keep`.
void prune(const fs::path& root, const fs::path& dir, int keep) {
  std::error_code ec;
  const std::vector<StepDir> steps = list_step_dirs(root, ec);
  TORCH_CHECK(!ec, "cannot list '", root.string(), "' to prune old checkpoints: ", ec.message());
  int kept = 0;
  int64_t oldest_kept = CheckpointManager::step_of(dir.string());
  std::vector<StepDir> doomed, incomplete;
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const bool is_dir = it->path.filename() == dir.filename();
    if (!is_dir && incompleteness(it->path)) {
      incomplete.push_back(*it);
    } else if (kept < keep || is_dir) {
      kept += kept < keep;
      oldest_kept = std::min(oldest_kept, it->step);
    } else {
      doomed.push_back(*it);
    }
  }
  for (const StepDir& s : incomplete) {
    // A DCP checkpoint (fsdp/dcp.h) in the same root is another format's, not a failed save.
    std::error_code dcp_ec;
    const bool dcp = fs::exists(s.path / ".metadata", dcp_ec) && !fs::exists(s.path / kMetadataFile, dcp_ec);
    if (s.step < oldest_kept && !dcp) doomed.push_back(s);
  }
  for (const StepDir& s : doomed) {
    fs::remove_all(s.path, ec);
    TORCH_CHECK(!ec, "cannot remove the old checkpoint '", s.path.string(), "': ", ec.message(),
                "; fix its permissions or remove it by hand");
  }
}

// Points root/latest at `dir`, then prunes (rank 0 only, inside the save's agreement).
void commit_latest(const fs::path& root, const fs::path& dir, int keep) {
  const std::string name = dir.filename().string();
  detail::write_file_durably(root / "latest", name.data(), name.size());
  detail::fsync_dir(root);
  if (keep > 0) prune(root, dir, keep);
}

// A host copy of a device piece, in pinned memory where the device can pin it, filled by a copy
// queued on the current stream: the caller waits for it.
at::Tensor queue_host_copy(const at::Tensor& local) {
  const bool pin = device::ops_for(local.device()).can_pin_host_memory();
  at::Tensor host = at::empty(local.sizes(), local.options().device(at::kCPU).pinned_memory(pin));
  host.copy_(local, /*non_blocking=*/true);
  return host;
}

// A copy of every local piece in fresh host memory, with the same layout: host pieces cloned,
// device pieces staged in pinned host memory as DCP's async save stages them, so that a save
// never holds a second copy of the state in device memory. Returns once every copy is done:
// the training may change the state, and the writer reads the copies, from then on.
ShardedStateDict staged_copy(const ShardedStateDict& state_dict) {
  ShardedStateDict out;
  std::vector<c10::Device> copied_from;
  for (const auto& item : state_dict) {
    const DTensor& d = item.value();
    const at::Tensor local = d.to_local().detach();
    at::Tensor copy = local.is_cpu() ? local.clone(at::MemoryFormat::Contiguous) : queue_host_copy(local);
    const bool new_device = std::find(copied_from.begin(), copied_from.end(), local.device()) == copied_from.end();
    if (!local.is_cpu() && new_device) copied_from.push_back(local.device());
    out.insert(item.key(), DTensor::from_local(copy, d.device_mesh(), d.placements(), d.sizes()));
  }
  for (const c10::Device& device : copied_from) {
    device::DeviceOps& ops = device::ops_for(device);
    ops.synchronize(ops.record(ops.current_stream(device)));
  }
  return out;
}

// The content of `path` when it is at most `limit` bytes; nullopt when it is longer or unreadable.
std::optional<std::string> read_small_file(const fs::path& path, size_t limit) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  std::string text(limit + 1, '\0');
  f.read(&text[0], static_cast<std::streamsize>(text.size()));
  if (f.bad()) return std::nullopt;
  text.resize(static_cast<size_t>(f.gcount()));
  if (text.size() > limit) return std::nullopt;
  return text;
}

std::string trimmed(const std::string& s) {
  const char* space = " \t\r\n\v\f";
  const size_t first = s.find_first_not_of(space);
  if (first == std::string::npos) return std::string();
  return s.substr(first, s.find_last_not_of(space) - first + 1);
}

// What incompleteness() said of the directory `latest` names, so that scan_steps need not
// check that directory a second time.
struct LatestDirCheck {
  std::string name;                // its name, step_<N>
  std::optional<std::string> why;  // nullopt: complete
};

// The step directory `latest` names (root/<name>), when `latest` is a regular file of at most
// kLatestMaxBytes whose content, trimmed, is exactly step_<N>; nothing otherwise.
std::optional<std::string> read_latest_name(const fs::path& file) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(file, ec))) return std::nullopt;  // a link is not ours
  const std::optional<std::string> text = read_small_file(file, kLatestMaxBytes);
  if (!text) return std::nullopt;
  std::string name = trimmed(*text);
  if (!parse_step_dir_name(name)) return std::nullopt;
  return name;
}

// Fills the `latest` part of a scan. Returns what it found of the directory `latest` names,
// when it got as far as checking one.
std::optional<LatestDirCheck> scan_latest(const fs::path& root, CheckpointManager::Scan* s) {
  const fs::path file = root / "latest";
  const std::string name = file.string();
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(file, ec);
  if (!fs::exists(status)) return std::nullopt;
  s->has_latest_file = true;
  // save() writes a regular file; a link may lead to any file on the machine, whose content
  // must not end up in a message.
  if (fs::is_symlink(status)) {
    s->findings.push_back(name + " is a symbolic link, not the file a save writes; it is not read");
    return std::nullopt;
  }
  if (!fs::is_regular_file(status)) {
    s->findings.push_back(name + " is not a regular file");
    return std::nullopt;
  }
  const std::optional<std::string> text = read_small_file(file, kLatestMaxBytes);
  if (!text) {
    s->findings.push_back(name + " cannot be read or is longer than " + std::to_string(kLatestMaxBytes) +
                          " bytes: it does not name a step directory");
    return std::nullopt;
  }
  s->latest_target = trimmed(*text);
  if (s->latest_target.empty()) {
    s->findings.push_back(name + " is empty");
    return std::nullopt;
  }
  // Only a well-formed name is quoted: anything else may be another file's content.
  if (!parse_step_dir_name(s->latest_target)) {
    s->findings.push_back(name + " does not hold a step_<N> name (" + std::to_string(s->latest_target.size()) +
                          " bytes, not shown)");
    return std::nullopt;
  }
  const std::string target = "'" + s->latest_target + "'";
  const fs::path dir = root / s->latest_target;
  LatestDirCheck check{s->latest_target, incompleteness(dir)};
  if (check.why) s->findings.push_back(name + " names " + target + ", which " + *check.why);
  else s->latest_complete = dir.string();
  return check;
}

// Fills the step directories' part of a scan; `latest` has been read, and `latest_dir` is what
// scan_latest found of the directory it names.
void scan_steps(const fs::path& root, const std::optional<LatestDirCheck>& latest_dir, CheckpointManager::Scan* s) {
  std::error_code ec;
  const std::vector<StepDir> steps = list_step_dirs(root, ec);
  if (ec) s->findings.push_back("cannot list " + root.string() + ": " + ec.message());
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const bool named_by_latest = latest_dir && it->path.filename() == latest_dir->name;
    const std::optional<std::string> why = named_by_latest ? latest_dir->why : incompleteness(it->path);
    if (!why && !s->newest_complete) s->newest_complete = it->path.string();
    // The directory `latest` names was reported with it.
    if (why && !named_by_latest) s->findings.push_back(it->path.string() + " " + *why);
  }
  const std::string latest = (root / "latest").string();
  if (!s->has_latest_file && s->newest_complete) {
    s->findings.push_back(latest + " is missing; the newest complete checkpoint is " + *s->newest_complete);
  }
  if (s->latest_complete && s->newest_complete &&
      CheckpointManager::step_of(*s->newest_complete) > CheckpointManager::step_of(*s->latest_complete)) {
    s->findings.push_back(latest + " names '" + s->latest_target + "', but " + *s->newest_complete +
                          " is newer and complete (saved after `latest` was last written)");
  }
}

}  // namespace

// The background saver: its own process group (so its collectives never interleave with the
// training's), and the write in flight.
struct CheckpointManager::Background {
  std::shared_ptr<ProcessGroup> group;
  std::future<void> pending;
  std::map<std::string, std::string> attributes;  // set_attributes
};

CheckpointManager::CheckpointManager(std::string root, int keep)
    : root_(std::move(root)), keep_(keep), background_(std::make_unique<Background>()) {}

CheckpointManager::~CheckpointManager() {
  try {
    wait();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "fsdp::CheckpointManager: the background save under '%s' failed: %s\n", root_.c_str(),
                 e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp::CheckpointManager: the background save under '%s' failed: %s\n", root_.c_str(),
                 e.what());
  }
}

void CheckpointManager::wait() {
  if (background_->pending.valid()) background_->pending.get();  // rethrows the save's error
}

bool CheckpointManager::poll() {
  std::future<void>& pending = background_->pending;
  if (!pending.valid()) return false;
  if (pending.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return true;
  pending.get();  // rethrows the save's error; the future is spent, so only once
  return false;
}

std::string CheckpointManager::save(int64_t step, const ShardedStateDict& state_dict) {
  wait();
  const fs::path root(root_), dir = root / ("step_" + std::to_string(step));
  const int keep = keep_;
  detail::write_checkpoint(
      dir.string(), state_dict, fsdp::world(), [&] { commit_latest(root, dir, keep); }, background_->attributes);
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
  const fs::path root(root_), dir = root / ("step_" + std::to_string(step));
  const int keep = keep_;
  auto group = background_->group;
  background_->pending = std::async(
      std::launch::async, [dir, root, keep, group, staged = std::move(staged), attributes = background_->attributes] {
        detail::write_checkpoint(
            dir.string(), staged, group, [&] { commit_latest(root, dir, keep); }, attributes);
      });
}

std::optional<std::string> CheckpointManager::latest() const {
  // Read as scan() reads it, so that the two never disagree on what `latest` names.
  const std::optional<std::string> name = read_latest_name(fs::path(root_) / "latest");
  if (!name) return std::nullopt;
  const fs::path dir = fs::path(root_) / *name;
  std::error_code ec;
  if (!fs::exists(dir / kMetadataFile, ec)) return std::nullopt;
  return dir.string();
}

CheckpointManager::Scan CheckpointManager::scan() const {
  Scan s;
  const fs::path root(root_);
  std::error_code ec;
  const fs::file_status status = fs::status(root, ec);
  if (!fs::exists(status)) return s;  // nothing saved yet
  if (!fs::is_directory(status)) {
    s.findings.push_back(root_ + " is not a directory");
    return s;
  }
  const std::optional<LatestDirCheck> latest_dir = scan_latest(root, &s);
  scan_steps(root, latest_dir, &s);
  return s;
}

void CheckpointManager::set_attributes(std::map<std::string, std::string> attributes) {
  background_->attributes = std::move(attributes);
}

std::map<std::string, std::string> CheckpointManager::attributes(const std::string& dir) {
  return detail::read_checkpoint_metadata(dir, "fsdp::CheckpointManager::attributes: ").attributes;
}

bool CheckpointManager::is_complete(const std::string& dir, std::string* why) {
  const std::optional<std::string> problem = incompleteness(dir);
  if (problem && why) *why = dir + " " + *problem;
  return !problem;
}

int64_t CheckpointManager::step_of(const std::string& dir) {
  const std::optional<int64_t> step = parse_step_dir_name(fs::path(dir).filename().string());
  TORCH_CHECK(step, "fsdp::CheckpointManager: '", dir,
              "' is not a step_<N> directory (N an integer); move anything "
              "else named step_* out of the checkpoint root");
  return *step;
}

}  // namespace fsdp
