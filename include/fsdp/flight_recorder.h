// layer: comm (what may include what: docs/architecture.md)
/// \file
/// fsdp/flight_recorder.h — each rank's record of its last collectives, dumped as JSON when a
/// job hangs or dies, so that a launcher (fsdprun) can say which rank is stuck where.
///
/// The recorder is always on. Every collective of every fsdp::ProcessGroup is recorded three
/// times: when it is enqueued (op, group, sequence number, bytes, dtype, and what FSDP was doing:
/// "forward"/"backward" and the module), when the backend starts running it, and when it finished
/// (completed or failed). The last `capacity` collectives are kept in a preallocated ring; older
/// ones are overwritten. Each record costs one short lock and no allocation.
///
/// Dumps (one JSON file per rank, `<dir>/rank_<R>.json`, rewritten by each dump until one for a
/// signal that ends the process was written: that one is kept) are written
///  - when a collective fails (a timeout, a peer that went away),
///  - on SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT and SIGTERM (then the signal takes its course:
///    the previous handler runs, or the default action),
///  - on SIGUSR1, without stopping the process,
///  - when the program calls dump() itself (fsdp-train does on a fatal error),
/// but only once a dump directory is set: FSDP_FLIGHT_RECORDER_DIR at init_process_group(), or
/// enable_dumps(). Without one, nothing is written and no signal handler is installed (SIGUSR1
/// keeps its default action). fsdprun sets FSDP_FLIGHT_RECORDER_DIR for every job.
/// The signal handlers only write one byte to a pipe: a watchdog thread writes the dump (then a
/// fatal signal continues at most ~3 s later, dump written or not).
///
/// \code{.cpp}
///   fsdp::FlightRecorder::global().enable_dumps("/tmp/flight", rank);
///   ...                                                   // train
///   fsdp::FlightRecorder::global().dump("my reason");     // or: kill -USR1 <pid>
/// \endcode
///
/// Backends. ProcessGroup's backend-independent half records "enqueued" (in make_work) and
/// "finished" (in finish_work) for every implementation. An implementation adds one call when it
/// starts running an operation (after waiting in its queue), from any thread:
/// \code{.cpp}
///   fsdp::FlightRecorder::global().started(name(), work->seq());
/// \endcode
/// Without it the dump shows the op as enqueued until it finishes, which is still correct.
///
/// Capacity: FSDP_FLIGHT_RECORDER_ENTRIES (default kDefaultCapacity), read on first use, or
/// set_capacity(). Every method is thread-safe; none communicates.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp {

/// The state of one recorded collective.
enum class FlightState : int8_t { kEnqueued = 0, kStarted, kCompleted, kFailed };
const char* to_string(FlightState s);  ///< "enqueued", "started", "completed" or "failed"

/// A copy of one record (what snapshot() returns). Times are wall-clock microseconds since the
/// Unix epoch (0: not yet), so that the dumps of different ranks can be compared.
struct FlightRecord {
  int64_t id = 0;           ///< this rank's running count of recorded collectives
  std::string group;        ///< ProcessGroup::name()
  std::string op;           ///< "all_gather", "reduce_scatter", ...
  int64_t seq = 0;          ///< the group's sequence number: the same op has the same seq on every rank
  int64_t bytes = 0;        ///< the largest tensor of the op (all-gather output, reduce-scatter input)
  std::string dtype;        ///< "Float", "BFloat16", "" for a barrier
  int64_t enqueued_us = 0;  ///< when the op was queued
  int64_t started_us = 0;   ///< when the communication thread started it
  int64_t finished_us = 0;  ///< when it completed or failed
  FlightState state = FlightState::kEnqueued;  ///< where it stands
  std::string phase;                           ///< what FSDP was doing when it was enqueued: "forward", "backward", ...
  std::string module;                          ///< the FSDP module (its fully qualified name; "" for the root)
};

/// The ring of this process's last collectives, and its dumps (see the file comment).
class FlightRecorder {
 public:
  /// Records kept unless FSDP_FLIGHT_RECORDER_ENTRIES or set_capacity says otherwise.
  static constexpr int64_t kDefaultCapacity = 4096;

  /// The process's recorder (every ProcessGroup records here).
  static FlightRecorder& global();

  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  /// Keeps the last `entries` (>= 1) collectives from now on; drops what was recorded.
  void set_capacity(int64_t entries);
  int64_t capacity() const;  ///< the records kept

  // ---- hooks of the process-group layer (see the file comment)
  /// A group's name and members (world ranks), shown in dumps. Called by ProcessGroup.
  void register_group(const std::string& name, const std::vector<int>& global_ranks);
  /** @{ */
  /// `op`/`dtype` must be NUL-terminated; they are copied (truncated to a few dozen chars).
  void enqueued(const std::string& group, const char* op, int64_t seq, int64_t bytes, const char* dtype);
  void started(const std::string& group, int64_t seq);
  void finished(const std::string& group, int64_t seq, bool ok);
  /** @} */

  // ---- what the rank is doing (set by FSDP's hooks; any program may set its own)
  /// Copied into every later record and into the dump as "last seen in". Truncated, not checked.
  void set_context(const char* phase, const std::string& module);

  /// The records, oldest first, and how many were recorded in all (more than returned after
  /// the ring wrapped).
  std::vector<FlightRecord> snapshot(int64_t* total_recorded = nullptr) const;
  /// The dump as a JSON object text (docs/failures.md, "Hangs: the flight recorder", shows one).
  std::string to_json(const std::string& reason) const;

  /// Sets the dump directory (created if missing) and this process's rank, and installs the
  /// signal handlers (once per process). Throws c10::Error naming the directory if it cannot be
  /// created.
  void enable_dumps(const std::string& dir, int rank);
  /** @{ */
  /// Whether enable_dumps() was called, and the directory it set.
  bool dumps_enabled() const;
  std::string dump_dir() const;
  /** @} */
  /// Writes `<dir>/rank_<R>.json` (through a temporary file and a rename, so a reader never sees
  /// half a dump). Returns its path, or "" when dumps are not enabled or writing failed (a dump
  /// is best effort: it never throws).
  std::string dump(const std::string& reason) noexcept;
  /// Called when a collective failed: the first message is kept and written in every later dump
  /// as "first_failure", then a dump is written.
  void note_failure(const std::string& message) noexcept;

 private:
  FlightRecorder();
  struct Impl;
  Impl* impl_;  ///< never freed: the recorder must outlive every thread that records
};

}  // namespace fsdp
