// The recorder behind fsdp/trace.h: one mutex-guarded vector of finished spans.
// Spans are recorded when they end (a few per module per step), so a lock is cheap enough and
// keeps the recorder simple; threads get small ids in order of their first span.
#include <fsdp/trace.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <vector>

namespace fsdp {
namespace trace {
namespace {

struct Event {
  const char* category;
  std::string name;
  Clock::time_point begin, end;
  int tid;
  std::string args;
};

struct Recorder {
  std::mutex mu;
  std::vector<Event> events;
  std::vector<std::string> thread_names;  // index = tid
  Clock::time_point origin = Clock::now();
  int64_t max_events = 0;
  int64_t dropped = 0;
};

std::atomic<bool> g_enabled{false};

Recorder& recorder() {
  static Recorder* r = new Recorder();  // never destroyed: comm threads may record at exit
  return *r;
}

// This thread's id in the trace; assigned under the recorder's lock.
int thread_id_locked(Recorder& r) {
  thread_local int tid = -1;
  if (tid < 0) {
    tid = static_cast<int>(r.thread_names.size());
    r.thread_names.push_back("thread " + std::to_string(tid));
  }
  return tid;
}

}  // namespace

void start(int64_t max_events) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events.clear();
  r.dropped = 0;
  r.max_events = max_events;
  r.origin = Clock::now();
  g_enabled.store(true, std::memory_order_relaxed);
}

void stop() { g_enabled.store(false, std::memory_order_relaxed); }

bool enabled() { return g_enabled.load(std::memory_order_relaxed); }

void record(const char* category, std::string name, Clock::time_point begin, Clock::time_point end, std::string args) {
  if (!enabled()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if (static_cast<int64_t>(r.events.size()) >= r.max_events) {
    ++r.dropped;
    return;
  }
  r.events.push_back({category, std::move(name), begin, end, thread_id_locked(r), std::move(args)});
}

void set_thread_name(std::string name) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  r.thread_names[thread_id_locked(r)] = std::move(name);
}

int64_t write_chrome_trace(const std::string& path, int pid) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  auto us = [&](Clock::time_point t) { return std::chrono::duration<double, std::micro>(t - r.origin).count(); };
  nlohmann::json events = nlohmann::json::array();
  events.push_back(
      {{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", "rank " + std::to_string(pid)}}}});
  for (size_t tid = 0; tid < r.thread_names.size(); ++tid) {
    events.push_back(
        {{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", r.thread_names[tid]}}}});
  }
  for (const Event& e : r.events) {
    nlohmann::json j = {{"ph", "X"},
                        {"cat", e.category},
                        {"name", e.name},
                        {"pid", pid},
                        {"tid", e.tid},
                        {"ts", us(e.begin)},
                        {"dur", us(e.end) - us(e.begin)}};
    if (!e.args.empty()) {
      nlohmann::json args = nlohmann::json::parse(e.args, nullptr, /*allow_exceptions=*/false);
      j["args"] = args.is_discarded() ? nlohmann::json{{"text", e.args}} : args;  // not JSON: keep it as text
    }
    events.push_back(std::move(j));
  }
  nlohmann::json doc = {
      {"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", {{"dropped_events", r.dropped}}}};
  // Names and args are the caller's bytes: replace what is not UTF-8 rather than fail.
  const std::string text = doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::ofstream out(path);
  TORCH_CHECK(out, "fsdp::trace::write_chrome_trace: cannot write '", path, "': ", std::strerror(errno),
              "; check that its directory exists and is writable");
  out << text << "\n";
  out.close();
  TORCH_CHECK(out, "fsdp::trace::write_chrome_trace: writing '", path, "' failed (disk full?)");
  return static_cast<int64_t>(r.events.size());
}

}  // namespace trace
}  // namespace fsdp
