// layer: util (what may include what: docs/architecture.md)
/// \file
/// fsdp/trace.h — a timeline of what FSDP and the training loop did, for Chrome's trace viewer
/// (chrome://tracing) or Perfetto (ui.perfetto.dev).
///
/// \code{.cpp}
///   fsdp::trace::start();                      // begin recording (off by default)
///   { fsdp::trace::Span s("compute", "forward"); ... }
///   fsdp::trace::write_chrome_trace("trace_rank0.json", /*pid=*/rank);
/// \endcode
///
/// While recording, the library adds spans of its own: every collective as it runs on its
/// group's communication thread ("all_gather #12", with its group and input bytes), and the time
/// the training thread spends waiting for an all-gather or a reduce-scatter ("wait all_gather
/// layers.0"). A span on the communication thread with no wait span under it on the training
/// thread is communication hidden behind compute. When recording is off a Span costs building
/// its name and one relaxed atomic load; the library's own spans skip even the name.
///
/// Every function here is thread-safe and none communicates.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace fsdp {
namespace trace {

using Clock = std::chrono::steady_clock;  ///< the clock of every span

/// Starts recording (clearing what was recorded before). Events past max_events are dropped
/// (counted, and reported in the written file) so that a long run cannot fill memory.
void start(int64_t max_events = 1000000);
/// Stops recording; what was recorded is kept for write_chrome_trace().
void stop();
bool enabled();  ///< true between start() and stop()

/// Records a span [begin, end) on the calling thread. `category` groups spans in the viewer
/// (e.g. "compute", "comm", "wait"); `args` is an optional JSON object text shown with the span.
void record(const char* category, std::string name, Clock::time_point begin, Clock::time_point end,
            std::string args = {});

/// Names the calling thread in the written trace (e.g. "train", "comm pg0").
void set_thread_name(std::string name);

/// Writes what was recorded in the Chrome trace event format (a JSON object with traceEvents),
/// times in microseconds from the first start(); `pid` labels the process (use the rank).
/// Returns the number of events written. Throws c10::Error naming the file if it cannot be
/// written. Text that is not UTF-8 in names and args is written with replacement characters.
int64_t write_chrome_trace(const std::string& path, int pid);

/// A span from construction to destruction on the calling thread; nothing when not recording.
class Span {
 public:
  /// Starts the span (see record() for `category` and `name`).
  Span(const char* category, std::string name) : category_(category) {
    if (enabled()) {
      name_ = std::move(name);
      begin_ = Clock::now();
      active_ = true;
    }
  }
  ~Span() {
    if (active_) record(category_, std::move(name_), begin_, Clock::now());
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* category_;
  std::string name_;
  Clock::time_point begin_;
  bool active_ = false;
};

}  // namespace trace
}  // namespace fsdp
