// dcp_checkpoints.h — fsdp-train's checkpoints in PyTorch's DCP layout
// (fsdp_config.checkpoint_format: dcp): checkpoint_dir/step_<N> directories written by
// save_dcp_state (checkpoint_state.h), complete once their .metadata exists (DCP writes it
// last), found for training.resume and pruned to training.keep_checkpoints. The project's own
// format is the CheckpointManager's (fsdp/checkpoint.h); this file never touches its directories.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp {
namespace train {

// root/step_<step>.
std::string dcp_step_dir(const std::string& root, int64_t step);

// True when `dir` holds a DCP .metadata and no metadata.json (the project format's): a DCP
// checkpoint, complete or not. Not collective; never throws.
bool is_dcp_dir(const std::string& dir);

// Among root/step_<N>, the DCP checkpoint with the largest N that is complete (fsdp/dcp.h's
// is_complete_dcp: its .metadata reads and every data file is there). None when there is none.
// Not collective; reads only .metadata files and file sizes; never throws.
std::optional<std::string> newest_complete_dcp(const std::string& root);

// Removes the complete DCP checkpoints root/step_<N> but the `keep` with the largest N, the one
// `just_saved` among them (keep 0 keeps all). Only directories named exactly step_<N> that is_dcp_dir()
// are touched. Returns one line per directory it could not remove ("" when none). Run by
// rank 0 after a save has completed everywhere.
std::string prune_dcp(const std::string& root, int64_t keep, const std::string& just_saved);

}  // namespace train
}  // namespace fsdp
