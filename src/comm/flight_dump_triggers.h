// flight_dump_triggers.h — the signals that make the flight recorder dump (fsdp/flight_recorder.h).
//
// The handlers are async-signal-safe: they write the signal number to a pipe and, for a signal
// that ends the process, wait (bounded) until the watchdog thread, which reads the pipe, has
// written the dump. Then the signal takes its course: for SIGTERM a handler installed before
// ours runs (fsdp-train's checkpoint-and-stop), otherwise the previous disposition is restored
// and the signal raised again.
#pragma once

namespace fsdp {
namespace comm {

// Installs the handlers (SIGUSR1, SIGTERM, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) and starts
// the watchdog thread; once per process, later calls do nothing. Throws c10::Error if the pipe
// or the thread cannot be made.
void install_flight_dump_triggers();

}  // namespace comm
}  // namespace fsdp
