// trainer.h — one fsdp-train run: set up, resume, train, checkpoint, export, sample; and the
// program's exit codes.
#pragma once

#include "config.h"

namespace fsdp {
namespace train {

// Exit codes of fsdp-train.
constexpr int kExitOk = 0;
// A runtime failure: I/O, a collective (timeout), a failed checkpoint save, a damaged input file
// (token file, init_from), no complete checkpoint for resume: auto where checkpoints exist.
constexpr int kExitError = 1;
// A bad configuration or command line, found before training: keys, values, sizes the machine
// cannot hold, paths that cannot be used (checkpoint_dir, init_from, training.resume).
constexpr int kExitConfig = 2;
// A step's loss or gradient norm became NaN or infinite; that step was not applied or saved.
constexpr int kExitNonFinite = 3;
// A run stopped by SIGTERM/SIGINT exits 128 + the signal number after saving a checkpoint.

// Trains as configured; every rank of the job calls it (after install_stop_signal_handlers,
// stop_signal.h, for the signal stop). Returns the process exit code; throws
// ConfigError for problems of the configuration found on the way (world size, seq_len, ...).
int run_training(const TrainConfig& cfg);

}  // namespace train
}  // namespace fsdp
