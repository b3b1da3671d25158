// trainer.h — one fsdp-train run: set up, resume, train, checkpoint, export, sample. Its exit
// codes are errors.h's.
#pragma once

#include "common/errors.h"
#include "config/config.h"

namespace fsdp {
namespace train {

// Trains as configured; every rank of the job calls it (after install_stop_signal_handlers,
// stop_signal.h, for the signal stop). Returns the process exit code; throws
// ConfigError for problems of the configuration found on the way (world size, seq_len, ...).
int run_training(const TrainConfig& cfg);

// `fsdp-train eval`: sets up as run_training does and loads the weights training would start
// from (training.resume's checkpoint, else model.init_from, else the seeded initialisation),
// then prints which, and `eval loss: <value>` (evaluation.h), on rank 0; the training data
// (data.path) is not read. Every rank of the job
// calls it. Takes the checkpoint directory's lock as a run does. Returns the exit code; throws
// ConfigError for the eval section's problems (eval.path unset, eval.batches past the file).
int run_evaluation(const TrainConfig& cfg);

}  // namespace train
}  // namespace fsdp
