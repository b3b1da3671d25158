// The flight recorder (fsdp/flight_recorder.h): the ring of records, the JSON dump.
// Records are fixed-size structs in a ring allocated once, so that recording never allocates
// (the map of in-flight ops reuses its nodes' memory after the first few steps).
#include <fsdp/flight_recorder.h>

#include "src/comm/flight_dump_triggers.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <unordered_map>

namespace fsdp {
namespace {

constexpr size_t kGroupChars = 48, kOpChars = 20, kDtypeChars = 16, kPhaseChars = 24, kModuleChars = 112;

struct Slot {
  int64_t id = -1;  // -1: empty
  int64_t seq = 0;
  int64_t bytes = 0;
  int64_t enqueued_us = 0, started_us = 0, finished_us = 0;
  FlightState state = FlightState::kEnqueued;
  char group[kGroupChars] = {0};
  char op[kOpChars] = {0};
  char dtype[kDtypeChars] = {0};
  char phase[kPhaseChars] = {0};
  char module[kModuleChars] = {0};
};

struct Context {
  char phase[kPhaseChars] = {0};
  char module[kModuleChars] = {0};
  int64_t since_us = 0;
};

template <size_t N>
void copy_text(char (&dst)[N], const char* src) {
  if (src == nullptr) src = "";
  std::strncpy(dst, src, N - 1);
  dst[N - 1] = '\0';
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t capacity_from_env() {
  const char* v = std::getenv("FSDP_FLIGHT_RECORDER_ENTRIES");
  if (v == nullptr || *v == '\0') return FlightRecorder::kDefaultCapacity;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  TORCH_CHECK(*end == '\0' && n >= 1 && n <= (int64_t{1} << 24), "FSDP_FLIGHT_RECORDER_ENTRIES='", v,
              "' must be a number of records between 1 and 16777216");
  return n;
}

void append_escaped(std::string& out, const char* s) {
  out += '"';
  for (; *s != '\0'; ++s) {
    const unsigned char c = static_cast<unsigned char>(*s);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x80) {  // control bytes, and bytes a truncation may have split
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c < 0x80 ? c : 0xfffd);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

void append_escaped(std::string& out, const std::string& s) { append_escaped(out, s.c_str()); }

}  // namespace

const char* to_string(FlightState s) {
  switch (s) {
    case FlightState::kEnqueued: return "enqueued";
    case FlightState::kStarted: return "started";
    case FlightState::kCompleted: return "completed";
    case FlightState::kFailed: return "failed";
  }
  return "?";
}

struct FlightRecorder::Impl {
  // A timed mutex so that a dump from the watchdog thread gives up, rather than hangs, when the
  // thread that crashed died holding it.
  mutable std::timed_mutex mu;
  std::vector<Slot> ring;
  int64_t next_id = 0;
  std::unordered_map<std::string, std::unordered_map<int64_t, int64_t>> in_flight;  // group -> seq -> id
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  Context context;
  std::string first_failure;
  // Dumps: set once by enable_dumps().
  std::mutex dump_mu;  // one dump at a time
  std::string dir;
  int rank = -1;
  bool enabled = false;
  // Set by the dump of a signal that ends the process (SIGTERM, a fault): later dumps (the
  // errors of a process running down, e.g. a collective that fails once its peers are gone) do
  // not replace the picture of where it was when it was told to end.
  std::string final_dump;

  Slot* slot_of(int64_t id) {
    Slot& s = ring[static_cast<size_t>(id % static_cast<int64_t>(ring.size()))];
    return s.id == id ? &s : nullptr;  // overwritten by a newer record
  }
  Slot* find(const std::string& group, int64_t seq, bool erase) {
    auto g = in_flight.find(group);
    if (g == in_flight.end()) return nullptr;
    auto it = g->second.find(seq);
    if (it == g->second.end()) return nullptr;
    const int64_t id = it->second;
    if (erase) g->second.erase(it);
    return slot_of(id);
  }
};

FlightRecorder& FlightRecorder::global() {
  static FlightRecorder* recorder = new FlightRecorder();  // never destroyed: see impl_
  return *recorder;
}

FlightRecorder::FlightRecorder() : impl_(new Impl) { impl_->ring.resize(static_cast<size_t>(capacity_from_env())); }

void FlightRecorder::set_capacity(int64_t entries) {
  TORCH_CHECK(entries >= 1, "FlightRecorder::set_capacity: need at least 1 entry, got ", entries);
  std::lock_guard<std::timed_mutex> lock(impl_->mu);
  impl_->ring.assign(static_cast<size_t>(entries), Slot{});
  impl_->in_flight.clear();
  impl_->next_id = 0;
}

int64_t FlightRecorder::capacity() const {
  std::lock_guard<std::timed_mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->ring.size());
}

void FlightRecorder::register_group(const std::string& name, const std::vector<int>& global_ranks) {
  std::lock_guard<std::timed_mutex> lock(impl_->mu);
  for (auto& g : impl_->groups) {
    if (g.first == name) {
      g.second = global_ranks;  // a group re-created after destroy_process_group()
      return;
    }
  }
  impl_->groups.emplace_back(name, global_ranks);
}

void FlightRecorder::enqueued(const std::string& group, const char* op, int64_t seq, int64_t bytes, const char* dtype) {
  const int64_t t = now_us();
  std::lock_guard<std::timed_mutex> lock(impl_->mu);
  const int64_t id = impl_->next_id++;
  Slot& s = impl_->ring[static_cast<size_t>(id % static_cast<int64_t>(impl_->ring.size()))];
  s.id = id;
  s.seq = seq;
  s.bytes = bytes;
  s.enqueued_us = t;
  s.started_us = s.finished_us = 0;
  s.state = FlightState::kEnqueued;
  copy_text(s.group, group.c_str());
  copy_text(s.op, op);
  copy_text(s.dtype, dtype);
  std::memcpy(s.phase, impl_->context.phase, kPhaseChars);
  std::memcpy(s.module, impl_->context.module, kModuleChars);
  impl_->in_flight[group][seq] = id;
}

void FlightRecorder::started(const std::string& group, int64_t seq) {
  const int64_t t = now_us();
  std::lock_guard<std::timed_mutex> lock(impl_->mu);
  if (Slot* s = impl_->find(group, seq, /*erase=*/false)) {
    s->started_us = t;
    s->state = FlightState::kStarted;
  }
}

void FlightRecorder::finished(const std::string& group, int64_t seq, bool ok) {
  const int64_t t = now_us();
  std::lock_guard<std::timed_mutex> lock(impl_->mu);
  if (Slot* s = impl_->find(group, seq, /*erase=*/true)) {
    s->finished_us = t;
    s->state = ok ? FlightState::kCompleted : FlightState::kFailed;
  }
}

void FlightRecorder::set_context(const char* phase, const std::string& module) {
  const int64_t t = now_us();
  std::lock_guard<std::timed_mutex> lock(impl_->mu);
  copy_text(impl_->context.phase, phase);
  copy_text(impl_->context.module, module.c_str());
  impl_->context.since_us = t;
}

namespace {

FlightRecord to_record(const Slot& s) {
  FlightRecord r;
  r.id = s.id;
  r.group = s.group;
  r.op = s.op;
  r.seq = s.seq;
  r.bytes = s.bytes;
  r.dtype = s.dtype;
  r.enqueued_us = s.enqueued_us;
  r.started_us = s.started_us;
  r.finished_us = s.finished_us;
  r.state = s.state;
  r.phase = s.phase;
  r.module = s.module;
  return r;
}

// The slots oldest first. Copies under the lock; the caller formats outside it.
std::vector<Slot> ordered_slots(const std::vector<Slot>& ring, int64_t next_id) {
  const int64_t cap = static_cast<int64_t>(ring.size());
  const int64_t first = next_id > cap ? next_id - cap : 0;
  std::vector<Slot> out;
  out.reserve(static_cast<size_t>(next_id - first));
  for (int64_t id = first; id < next_id; ++id) out.push_back(ring[static_cast<size_t>(id % cap)]);
  return out;
}

}  // namespace

std::vector<FlightRecord> FlightRecorder::snapshot(int64_t* total_recorded) const {
  std::vector<Slot> slots;
  {
    std::lock_guard<std::timed_mutex> lock(impl_->mu);
    slots = ordered_slots(impl_->ring, impl_->next_id);
    if (total_recorded != nullptr) *total_recorded = impl_->next_id;
  }
  std::vector<FlightRecord> out;
  out.reserve(slots.size());
  for (const Slot& s : slots) out.push_back(to_record(s));
  return out;
}

std::string FlightRecorder::to_json(const std::string& reason) const {
  std::vector<Slot> slots;
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  Context context;
  std::string first_failure;
  int64_t total = 0, cap = 0;
  // If the lock cannot be had (a thread died holding it), dump what is there: a record being
  // written at that moment may be torn, the rest is still worth reading.
  std::unique_lock<std::timed_mutex> lock(impl_->mu, std::defer_lock);
  const bool locked = lock.try_lock_for(std::chrono::seconds(1));
  slots = ordered_slots(impl_->ring, impl_->next_id);
  groups = impl_->groups;
  context = impl_->context;
  first_failure = impl_->first_failure;
  total = impl_->next_id;
  cap = static_cast<int64_t>(impl_->ring.size());
  if (locked) lock.unlock();

  std::string out;
  out.reserve(256 + slots.size() * 260);
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  out += "{\n  \"version\": 1,\n  \"rank\": " + std::to_string(impl_->rank) +
         ",\n  \"pid\": " + std::to_string(getpid()) + ",\n  \"host\": ";
  append_escaped(out, host);
  out += ",\n  \"reason\": ";
  append_escaped(out, reason);
  out += ",\n  \"dump_time_us\": " + std::to_string(now_us()) + ",\n  \"consistent\": " + (locked ? "true" : "false") +
         ",\n  \"first_failure\": ";
  append_escaped(out, first_failure);
  out += ",\n  \"last_seen\": {\"phase\": ";
  append_escaped(out, context.phase);
  out += ", \"module\": ";
  append_escaped(out, context.module);
  out += ", \"since_us\": " + std::to_string(context.since_us) + "},\n  \"capacity\": " + std::to_string(cap) +
         ",\n  \"total_recorded\": " + std::to_string(total) + ",\n  \"groups\": [";
  for (size_t i = 0; i < groups.size(); ++i) {
    out += i ? ",\n    {\"name\": " : "\n    {\"name\": ";
    append_escaped(out, groups[i].first);
    out += ", \"ranks\": [";
    for (size_t k = 0; k < groups[i].second.size(); ++k) out += (k ? ", " : "") + std::to_string(groups[i].second[k]);
    out += "]}";
  }
  out += groups.empty() ? "],\n  \"entries\": [" : "\n  ],\n  \"entries\": [";
  for (size_t i = 0; i < slots.size(); ++i) {
    const Slot& s = slots[i];
    out += i ? ",\n    {\"id\": " : "\n    {\"id\": ";
    out += std::to_string(s.id) + ", \"group\": ";
    append_escaped(out, s.group);
    out += ", \"op\": ";
    append_escaped(out, s.op);
    out += ", \"seq\": " + std::to_string(s.seq) + ", \"bytes\": " + std::to_string(s.bytes) + ", \"dtype\": ";
    append_escaped(out, s.dtype);
    out += ", \"state\": \"" + std::string(to_string(s.state)) +
           "\", \"enqueued_us\": " + std::to_string(s.enqueued_us) +
           ", \"started_us\": " + std::to_string(s.started_us) + ", \"finished_us\": " + std::to_string(s.finished_us) +
           ", \"phase\": ";
    append_escaped(out, s.phase);
    out += ", \"module\": ";
    append_escaped(out, s.module);
    out += "}";
  }
  out += slots.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return out;
}

void FlightRecorder::enable_dumps(const std::string& dir, int rank) {
  TORCH_CHECK(!dir.empty(), "FlightRecorder::enable_dumps: the dump directory is empty");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TORCH_CHECK(!ec && std::filesystem::is_directory(dir), "fsdp flight recorder: cannot create the dump directory '",
              dir, "' (", ec.message(), "); set FSDP_FLIGHT_RECORDER_DIR to a writable directory or unset it");
  {
    std::lock_guard<std::mutex> lock(impl_->dump_mu);
    impl_->dir = dir;
    impl_->rank = rank;
    impl_->enabled = true;
  }
  comm::install_flight_dump_triggers();
}

bool FlightRecorder::dumps_enabled() const {
  std::lock_guard<std::mutex> lock(impl_->dump_mu);
  return impl_->enabled;
}

std::string FlightRecorder::dump_dir() const {
  std::lock_guard<std::mutex> lock(impl_->dump_mu);
  return impl_->dir;
}

std::string FlightRecorder::dump(const std::string& reason) noexcept {
  try {
    std::lock_guard<std::mutex> lock(impl_->dump_mu);
    if (!impl_->enabled) return "";
    if (!impl_->final_dump.empty()) return impl_->final_dump;
    const std::string text = to_json(reason);
    const std::string path = impl_->dir + "/rank_" + std::to_string(impl_->rank) + ".json";
    const std::string tmp = path + ".tmp" + std::to_string(getpid());
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << text;
      out.flush();
      if (!out) return "";
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) return "";
    if (reason.rfind("signal ", 0) == 0 && reason != "signal SIGUSR1") impl_->final_dump = path;
    return path;
  } catch (...) {
    return "";
  }
}

void FlightRecorder::note_failure(const std::string& message) noexcept {
  try {
    {
      std::lock_guard<std::timed_mutex> lock(impl_->mu);
      if (!impl_->first_failure.empty()) return;  // later failures follow from the first
      impl_->first_failure = message;
    }
    dump("collective failed: " + message);
  } catch (...) {
  }
}

}  // namespace fsdp
