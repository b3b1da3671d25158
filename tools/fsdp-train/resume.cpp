// resume.cpp — training.resume's choice of checkpoint (resume.h).
#include "resume.h"

#include "config.h"

#include <filesystem>
#include <stdexcept>
#include <system_error>

namespace fsdp {
namespace train {
namespace {

// Whether root holds step_* directories (complete or not): the traces of an earlier run.
bool has_step_dirs(const std::string& root) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().rfind("step_", 0) == 0) return true;
  return false;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += (s.empty() ? "" : "; ") + l;
  return s;
}

ResumeChoice explicit_checkpoint(const std::string& dir) {
  std::string why;
  if (!CheckpointManager::is_complete(dir, &why)) throw ConfigError("training.resume: not a complete checkpoint: " + why);
  return {dir, {}};
}

// The scan's findings say what is wrong, each naming its path.
ResumeChoice latest_or_newest(const CheckpointManager::Scan& scan, const std::string& root) {
  ResumeChoice c;
  for (const auto& f : scan.findings) c.notes.push_back("resume: found " + f);
  if (const std::optional<std::string> dir = resumable_checkpoint(scan)) {
    c.dir = *dir;
    const char* why = scan.latest_complete ? ", which latest names" : ", the newest complete checkpoint";
    if (!c.notes.empty()) c.notes.push_back("resume: using " + c.dir + why);
    return c;
  }
  if (scan.has_latest_file || has_step_dirs(root) || !scan.findings.empty())
    throw std::runtime_error("training.resume: auto: " + root + " holds checkpoints but none is complete (" +
                             (scan.findings.empty() ? root + "/latest names nothing usable" : joined(scan.findings)) +
                             "). Nothing was started and nothing deleted: repair them, set training.resume to a "
                             "complete checkpoint, or set training.resume: never to start from step 0");
  return c;  // nothing saved yet: a new run
}

}  // namespace

std::optional<std::string> resumable_checkpoint(const CheckpointManager::Scan& scan) {
  return scan.latest_complete ? scan.latest_complete : scan.newest_complete;
}

ResumeChoice resume_choice(const std::string& resume, const CheckpointManager& checkpoints, const std::string& root) {
  if (resume == "never") return {};
  if (resume != "auto") return explicit_checkpoint(resume);
  return latest_or_newest(checkpoints.scan(), root);
}

}  // namespace train
}  // namespace fsdp
