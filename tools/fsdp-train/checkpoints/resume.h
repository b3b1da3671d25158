// resume.h — which checkpoint training.resume selects. Rank 0 decides (resume_choice) and the
// trainer shares the decision with every rank, so ranks whose disks differ (node-local
// checkpoint directories) still agree on one checkpoint, or all fail naming the rank that
// cannot read it.
#pragma once

#include <fsdp/checkpoint.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {
namespace train {

struct ResumeChoice {
  std::string dir;                 // the checkpoint to load; empty = start from step 0
  std::vector<std::string> notes;  // what was found and what is used, for rank 0 to print
};

// The checkpoint a scan offers to continue from: the one `latest` names when it is complete,
// else the newest complete step_<N>; none when no checkpoint is complete.
std::optional<std::string> resumable_checkpoint(const CheckpointManager::Scan& scan);

// The complete checkpoint under `root`, in either format, with the largest step below `dir`'s,
// for a run that cannot load `dir`; none when there is none. Not collective.
std::optional<std::string> older_complete_checkpoint(const std::string& root, const std::string& dir);

// Among root/step_<N>, the one with the largest N whose save finished, in either format: it
// holds its last-written file (the project format's metadata.json, DCP's .metadata), whatever
// else is wrong with it. A directory without one is an interrupted save. None when there is
// none. Not collective; never throws.
std::optional<std::string> newest_saved_checkpoint(const std::string& root);

// Why `dir`, in either format, is not a complete checkpoint ("" when it is): the file, key or
// check that failed, as the format's reader says it. Reads only metadata and file sizes (not
// the data: checksums and keys are checked as it loads). Not collective; never throws.
std::string checkpoint_problem(const std::string& dir);

// The one message a run stops with when a checkpoint whose save finished cannot be used,
// whether training.resume named it or auto found it, and whether the scan or the load found
// what is wrong (`why`: the file, the key or the check). It names `dir`, says that nothing was
// started or pruned, and names the older complete checkpoint under dir's parent with the steps
// it is behind and how to continue from it by hand (move `dir` aside, to a name no run reads,
// prunes or overwrites). Not collective.
std::string unusable_checkpoint_message(const std::string& dir, const std::string& why);

// training.resume:
//   never   start from step 0 (whatever the directory holds);
//   <path>  that checkpoint, in either format (a directory with a DCP .metadata, e.g. a Python
//           trainer's dcp.save, is read as DCP); ConfigError naming it when it holds no
//           checkpoint's last file; std::runtime_error with unusable_checkpoint_message when it
//           does but is not complete;
//   auto    first, the newest checkpoint whose save finished (newest_saved_checkpoint) must be
//           complete: std::runtime_error with unusable_checkpoint_message otherwise. auto never
//           falls back to an older checkpoint past one that was saved and is damaged: only
//           interrupted saves are passed over, each with a note. Then the newest complete
//           DCP checkpoint root/step_<N> (dcp_checkpoints.h) when its N is larger than that of
//           the checkpoint the project format offers (below); otherwise
//   (auto)  the checkpoint `latest` names when it is complete; else the newest complete
//           step_<N>, with notes saying what was wrong and what is used instead; else, when
//           `root` holds a `latest` file or step_* directories, std::runtime_error naming
//           what was found (nothing is started over, nothing deleted); else step 0.
// With auto, the chosen checkpoint's recorded run identity (run_identity.h) must match
// `identity`: ConfigError naming each difference and the remedies otherwise, unless
// `allow_mismatch` (training.allow_resume_mismatch), which only notes them. An explicit <path>
// is the user's own choice: differences are notes. A checkpoint recording no identity (saved by
// an older fsdp-train) resumes as before.
// Not collective: reads only small files under root.
ResumeChoice resume_choice(const std::string& resume, const CheckpointManager& checkpoints, const std::string& root,
                           const std::map<std::string, std::string>& identity = {}, bool allow_mismatch = false);

}  // namespace train
}  // namespace fsdp
