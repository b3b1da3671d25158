// trainer.h — one fsdp-train run: set up, resume, train, checkpoint, export, sample. Its exit
// codes are errors.h's.
#pragma once

#include "config.h"
#include "errors.h"

namespace fsdp {
namespace train {

// Trains as configured; every rank of the job calls it (after install_stop_signal_handlers,
// stop_signal.h, for the signal stop). Returns the process exit code; throws
// ConfigError for problems of the configuration found on the way (world size, seq_len, ...).
int run_training(const TrainConfig& cfg);

}  // namespace train
}  // namespace fsdp
