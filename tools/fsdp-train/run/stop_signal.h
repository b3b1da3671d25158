// stop_signal.h — SIGTERM/SIGINT as a request to stop training. The handler only records the
// signal; the training loop reads it once per step and stops all ranks at the same step.
#pragma once

namespace fsdp {
namespace train {

// Installs SIGTERM/SIGINT handlers that ask the training loop to stop after the current step
// (a second signal terminates at once).
void install_stop_signal_handlers();

// The signal received, or 0 when none was.
int stop_signal();

}  // namespace train
}  // namespace fsdp
