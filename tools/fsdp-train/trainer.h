// trainer.h — one fsdp-train run: set up, resume, train, checkpoint, export, sample; and the
// program's exit codes.
#pragma once

#include "config.h"

namespace fsdp {
namespace train {

// Exit codes of fsdp-train.
constexpr int kExitOk = 0;
constexpr int kExitError = 1;          // a runtime failure (I/O, collective, checkpoint, ...)
constexpr int kExitConfig = 2;         // a bad configuration or command line
constexpr int kExitNonFinite = 3;      // the loss became NaN or infinite
// A run stopped by SIGTERM/SIGINT exits 128 + the signal number after saving a checkpoint.

// Trains as configured; every rank of the job calls it (after install_stop_signal_handlers,
// stop_signal.h, for the signal stop). Returns the process exit code; throws
// ConfigError for problems of the configuration found on the way (world size, seq_len, ...).
int run_training(const TrainConfig& cfg);

}  // namespace train
}  // namespace fsdp
