// dcp_checkpoints.cpp — finding and pruning fsdp-train's DCP checkpoints (dcp_checkpoints.h).
#include "checkpoints/dcp_checkpoints.h"

#include <fsdp/checkpoint.h>
#include <fsdp/dcp.h>

#include <filesystem>
#include <map>
#include <system_error>

namespace fsdp {
namespace train {
namespace {

namespace fs = std::filesystem;

// step -> directory, for every root/step_<N> that is_dcp_dir().
std::map<int64_t, std::string> dcp_dirs(const std::string& root) {
  std::map<int64_t, std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string path = it->path().string();
    try {
      const int64_t step = CheckpointManager::step_of(path);
      if (is_dcp_dir(path)) out[step] = path;
    } catch (const std::exception&) {
      // not a step_<N>: none of ours
    }
  }
  return out;
}

}  // namespace

std::string dcp_step_dir(const std::string& root, int64_t step) {
  return (fs::path(root) / ("step_" + std::to_string(step))).string();
}

bool is_dcp_dir(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::path(dir) / ".metadata", ec) && !fs::exists(fs::path(dir) / "metadata.json", ec);
}

std::optional<std::string> newest_complete_dcp(const std::string& root) {
  const std::map<int64_t, std::string> dirs = dcp_dirs(root);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    if (is_complete_dcp(it->second)) return it->second;
  }
  return std::nullopt;
}

std::string prune_dcp(const std::string& root, int64_t keep, const std::string& just_saved) {
  if (keep <= 0) return "";
  std::string problems;
  int64_t kept = 0;
  const std::map<int64_t, std::string> dirs = dcp_dirs(root);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    if (!is_complete_dcp(it->second)) continue;  // an interrupted save is no checkpoint to count
    if (fs::path(it->second) == fs::path(just_saved) || kept < keep) {
      ++kept;
      continue;
    }
    std::error_code ec;
    fs::remove_all(it->second, ec);
    if (ec) problems += (problems.empty() ? "" : "; ") + ("cannot remove " + it->second + ": " + ec.message());
  }
  return problems;
}

}  // namespace train
}  // namespace fsdp
