// resume.cpp — training.resume's choice of checkpoint (resume.h).
#include "checkpoints/resume.h"

#include "checkpoints/dcp_checkpoints.h"
#include "checkpoints/run_identity.h"
#include "config/config.h"

#include <fsdp/dcp.h>

#include <algorithm>
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

namespace fs = std::filesystem;

// Whether `dir` holds the file a save of either format writes last: its save finished.
bool save_finished(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::path(dir) / "metadata.json", ec) || fs::exists(fs::path(dir) / ".metadata", ec);
}

// A path that holds no checkpoint is the configuration's mistake; one whose save finished but
// that cannot be used is the checkpoint's, and stops as auto stops on it.
ResumeChoice explicit_checkpoint(const std::string& dir) {
  if (!save_finished(dir)) {
    std::string why;
    CheckpointManager::is_complete(dir, &why);
    throw ConfigError("training.resume: not a complete checkpoint: " + why);
  }
  const std::string problem = checkpoint_problem(dir);
  if (!problem.empty()) throw std::runtime_error("training.resume: " + unusable_checkpoint_message(dir, problem));
  return {dir, {}};
}

// A line for each step_<N> under root newer than `dir` whose save never finished: what auto
// passes over when it takes `dir`.
std::vector<std::string> interrupted_saves_after(const std::string& root, const std::string& dir) {
  std::vector<std::string> lines;
  const int64_t chosen = CheckpointManager::step_of(dir);
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string path = it->path().string();
    try {
      if (CheckpointManager::step_of(path) > chosen && !save_finished(path))
        lines.push_back("resume: found " + path +
                        ", which holds neither .metadata nor metadata.json (an interrupted save): passed over");
    } catch (const std::exception&) {
      // not a step_<N>: none of ours
    }
  }
  std::sort(lines.begin(), lines.end());
  return lines;
}

// The steps between `older` and `dir` as "N steps behind it", or "" when either is no step_<N>.
std::string steps_behind(const std::string& older, const std::string& dir) {
  try {
    const int64_t n = CheckpointManager::step_of(dir) - CheckpointManager::step_of(older);
    return std::to_string(n) + (n == 1 ? " step" : " steps") + " behind it";
  } catch (const std::exception&) {
    return "";
  }
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

// Whether finding `f` is about one of root's DCP checkpoints.
bool mentions_dcp_dir(const std::string& f, const std::string& root) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string path = it->path().string();
    if (f.find(path + " ") != std::string::npos && is_dcp_dir(path)) return true;
  }
  return false;
}

// The differences between the identity `dir` records and ours; none when it records none.
std::vector<std::string> differences(const std::string& dir, const std::map<std::string, std::string>& identity) {
  if (identity.empty()) return {};
  const std::string name = std::filesystem::path(dir).filename().string();
  return identity_differences(name, CheckpointManager::attributes(dir), identity);
}

// auto must not continue another run's checkpoints as if they were this one's.
void check_identity(ResumeChoice* c, const std::string& root, const std::map<std::string, std::string>& identity,
                    bool allow_mismatch) {
  const std::vector<std::string> diffs = differences(c->dir, identity);
  if (diffs.empty()) return;
  if (allow_mismatch) {
    for (const auto& d : diffs) c->notes.push_back("resume: " + d + " (training.allow_resume_mismatch: true)");
    return;
  }
  throw ConfigError("training.resume: auto: " + joined(diffs) + ". " + root +
                    " holds another run's checkpoints (or this run's under another configuration); nothing was "
                    "started. Set fsdp_config.checkpoint_dir to a directory of its own for this run, "
                    "training.resume: never to start from step 0 (the checkpoints there are pruned as new ones "
                    "are saved), or training.allow_resume_mismatch: true to resume from it anyway");
}

}  // namespace

std::optional<std::string> resumable_checkpoint(const CheckpointManager::Scan& scan) {
  return scan.latest_complete ? scan.latest_complete : scan.newest_complete;
}

std::string checkpoint_problem(const std::string& dir) {
  std::string why;
  const bool complete = is_dcp_dir(dir) ? is_complete_dcp(dir, &why) : CheckpointManager::is_complete(dir, &why);
  if (complete) return "";
  return why.empty() ? dir + " cannot be read" : why;
}

std::optional<std::string> newest_saved_checkpoint(const std::string& root) {
  std::optional<std::string> best;
  int64_t best_step = -1;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string path = it->path().string();
    try {
      const int64_t step = CheckpointManager::step_of(path);
      if (step > best_step && save_finished(path)) best = path, best_step = step;
    } catch (const std::exception&) {
      // not a step_<N>: none of ours
    }
  }
  return best;
}

// Stopping, not passing over: a checkpoint whose save finished and that fails a check was
// changed after its save (or is one this build cannot read), so what to do is a person's call.
// Going on from an older one drops the steps in between, and the run would save that step again
// into the damaged directory and prune it: the evidence of what happened.
std::string unusable_checkpoint_message(const std::string& dir, const std::string& why) {
  const fs::path path(dir);
  const std::string root = path.parent_path().string();
  const bool ends_sentence = !why.empty() && (why.back() == '.' || why.back() == '?');
  std::string m = "cannot resume from " + dir + ": its save finished, but it cannot be used: " + why +
                  (ends_sentence ? " " : ". ") + "Nothing was started, and nothing pruned or deleted: " + dir +
                  " stays as it is; fsdp-train never falls back past it by itself";
  const std::string aside = (path.parent_path() / ("damaged-" + path.filename().string())).string();
  const std::optional<std::string> older = older_complete_checkpoint(root, dir);
  if (older) {
    const std::string behind = steps_behind(*older, dir);
    return m + ". The older complete checkpoint " + *older + (behind.empty() ? "" : " is " + behind + ";") +
           " to continue from it, move the damaged one aside, where no run reads, prunes or overwrites it (mv " + dir +
           " " + aside + "), and run again: training.resume: auto then takes " + *older;
  }
  return m + ". No older complete checkpoint is under " + root + ": point training.resume at another checkpoint, " +
         "or move the damaged one aside (mv " + dir + " " + aside + ") and set training.resume: never to start " +
         "from step 0";
}

std::optional<std::string> older_complete_checkpoint(const std::string& root, const std::string& dir) {
  int64_t below = 0;
  try {
    below = CheckpointManager::step_of(dir);
  } catch (const std::exception&) {
    return std::nullopt;  // not a step_<N>: no order to go back in
  }
  std::optional<std::string> best;
  int64_t best_step = -1;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string path = it->path().string();
    int64_t step = -1;
    try {
      step = CheckpointManager::step_of(path);
    } catch (const std::exception&) {
      continue;  // not one of the manager's directories
    }
    if (step < below && step > best_step && save_finished(path) && checkpoint_problem(path).empty())
      best = path, best_step = step;
  }
  return best;
}

ResumeChoice resume_choice(const std::string& resume, const CheckpointManager& checkpoints, const std::string& root,
                           const std::map<std::string, std::string>& identity, bool allow_mismatch) {
  if (resume == "never") return {};
  if (resume != "auto") {
    ResumeChoice c = explicit_checkpoint(resume);
    if (is_dcp_dir(c.dir)) return c;  // a DCP checkpoint records no run identity
    for (const auto& d : differences(c.dir, identity)) c.notes.push_back("resume: note: " + d);
    return c;
  }
  if (const std::optional<std::string> newest = newest_saved_checkpoint(root)) {
    const std::string problem = checkpoint_problem(*newest);
    if (!problem.empty())
      throw std::runtime_error("training.resume: auto: " + unusable_checkpoint_message(*newest, problem));
  }
  CheckpointManager::Scan scan = checkpoints.scan();
  if (const std::optional<std::string> dcp = newest_complete_dcp(root)) {
    // Either format: the newer checkpoint wins. The manager's scan sees DCP directories as
    // incomplete saves of its own format: those findings are not problems.
    const std::optional<std::string> own = resumable_checkpoint(scan);
    if (!own || CheckpointManager::step_of(*dcp) > CheckpointManager::step_of(*own)) {
      ResumeChoice c{*dcp, interrupted_saves_after(root, *dcp)};
      c.notes.push_back("resume: using " + *dcp + ", the newest complete checkpoint (DCP layout)");
      return c;
    }
    std::vector<std::string> findings;
    for (const auto& f : scan.findings)
      if (f.find("metadata.json") == std::string::npos || !mentions_dcp_dir(f, root)) findings.push_back(f);
    scan.findings = findings;
  }
  ResumeChoice c = latest_or_newest(scan, root);
  if (!c.dir.empty()) check_identity(&c, root, identity, allow_mismatch);
  return c;
}

}  // namespace train
}  // namespace fsdp
