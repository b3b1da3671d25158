// The progress board (progress_board.h): the publishing thread, and the reads a diagnosis makes.
#include "src/comm/progress_board.h"

#include "src/comm/store_server.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace fsdp {
namespace comm {

namespace {

// The counter a rank's publishing thread bumps every kHeartbeat while its process runs.
std::string heartbeat_key(int rank) { return "alive/" + std::to_string(rank); }
// Set when a rank leaves the job (its board is destroyed).
std::string left_key(int rank) { return "left/" + std::to_string(rank); }
// "<machine> <pid>": which process a rank is, for ranks on the same machine to look at.
std::string whois_key(int rank) { return "whois/" + std::to_string(rank); }

// How a rank named its host (ProgressBoard::this_host), for a timeout to name lost hosts.
std::string host_key(int rank) { return "host/" + std::to_string(rank); }

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The kernel this process runs on (its boot id) and its pid namespace: two processes that
// agree on both can look at each other's /proc entries.
std::string this_machine() {
  char ns[128] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  return read_first_line("/proc/sys/kernel/random/boot_id") + "/" + std::string(ns, n > 0 ? static_cast<size_t>(n) : 0);
}

// The state letter of process `pid` (R, S, D, T, t, Z, ...), or 0 when there is no such process.
char process_state(long pid) {
  const std::string stat = read_first_line("/proc/" + std::to_string(pid) + "/stat");
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return 0;
  return stat[paren + 2];
}

// A value publish_dirty() wrote: a sequence number in decimal.
int64_t parse_seq(const std::string& key, const std::vector<uint8_t>& value) {
  const std::string text(value.begin(), value.end());
  errno = 0;
  char* end = nullptr;
  const long long seq = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(!text.empty() && end == text.c_str() + text.size() && errno == 0, "fsdp: store key '", key, "' holds '",
              text,
              "', not a collective sequence number; is another program using this job's "
              "store (MASTER_ADDR/MASTER_PORT)?");
  return static_cast<int64_t>(seq);
}

}  // namespace

ProgressBoard::ProgressBoard(c10::intrusive_ptr<c10d::Store> store, int global_rank, const std::string& where)
    : store_(store, store->getTimeout(), where), rank_(global_rank), thread_([this] { publish_loop(); }) {
  introduce();
}

void ProgressBoard::leave() {
  try {
    std::lock_guard<std::mutex> lock(store_mu_);
    store_.set(left_key(rank_), std::vector<uint8_t>{1});
  } catch (const std::exception&) {
    // The store is gone already (rank 0 left first): nobody is left to diagnose.
  }
}

ProgressBoard::~ProgressBoard() {
  leave();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ProgressBoard::entered(const std::string& group, int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[group];
  e.seq = seq;
  e.dirty = true;
}

std::string ProgressBoard::key(const std::string& group, int rank) const {
  return "progress/" + group + "/" + std::to_string(rank);
}

void ProgressBoard::publish_dirty() {
  std::vector<std::pair<std::string, int64_t>> todo;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : entries_) {
      if (!kv.second.dirty) continue;
      kv.second.dirty = false;
      todo.emplace_back(kv.first, kv.second.seq);
    }
  }
  std::lock_guard<std::mutex> lock(store_mu_);
  for (const auto& item : todo) {
    std::string v = std::to_string(item.second);
    store_.set(key(item.first, rank_), std::vector<uint8_t>(v.begin(), v.end()));
  }
}

std::string ProgressBoard::this_host() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  std::string label = name;
  for (const char* var : {"FSDP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    const char* iface = std::getenv(var);
    if (iface == nullptr || *iface == '\0') continue;
    const std::string first = std::string(iface).substr(0, std::string(iface).find(','));
    try {
      label += " (" + address_of_interface(first) + ")";
    } catch (const std::exception&) {
      // The transport names the interface in its own error; the host name alone names the host.
    }
    break;
  }
  return label;
}

std::string ProgressBoard::host_of(int global_rank) {
  std::lock_guard<std::mutex> lock(store_mu_);
  if (!store_.check({host_key(global_rank)})) return "";
  const std::vector<uint8_t> value = store_.get(host_key(global_rank));
  return std::string(value.begin(), value.end());
}

void ProgressBoard::introduce() {
  const std::string who = this_machine() + " " + std::to_string(getpid());
  const std::string host = this_host();
  try {
    std::lock_guard<std::mutex> lock(store_mu_);
    store_.set(host_key(rank_), std::vector<uint8_t>(host.begin(), host.end()));
    store_.set(whois_key(rank_), std::vector<uint8_t>(who.begin(), who.end()));
  } catch (const std::exception&) {
    // Without it, a diagnosis calls this rank silent rather than stopped or gone.
  }
}

ProgressBoard::Fate ProgressBoard::fate(int global_rank) {
  std::string who;
  {
    std::lock_guard<std::mutex> lock(store_mu_);
    if (store_.check({left_key(global_rank)})) return Fate::kLeft;
    if (!store_.check({whois_key(global_rank)})) return Fate::kSilent;
    const std::vector<uint8_t> value = store_.get(whois_key(global_rank));
    who.assign(value.begin(), value.end());
  }
  const auto space = who.rfind(' ');
  if (space == std::string::npos || who.substr(0, space) != this_machine()) return Fate::kSilent;
  const char state = process_state(std::strtol(who.c_str() + space + 1, nullptr, 10));
  if (state == 0 || state == 'Z' || state == 'X') return Fate::kGone;
  if (state == 'T' || state == 't') return Fate::kStopped;
  return Fate::kSilent;
}

void ProgressBoard::beat() {
  std::lock_guard<std::mutex> lock(store_mu_);
  store_.add(heartbeat_key(rank_), 1);
}

void ProgressBoard::publish_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  auto next_beat = std::chrono::steady_clock::now();
  while (!stopping_) {
    cv_.wait_for(lock, kPeriod);
    if (stopping_) break;
    lock.unlock();
    try {
      publish_dirty();
      if (std::chrono::steady_clock::now() >= next_beat) {
        beat();
        next_beat = std::chrono::steady_clock::now() + kHeartbeat;
      }
    } catch (const std::exception&) {
      // The store went away (e.g. rank 0 died). Diagnosis will say so; keep the thread alive.
    }
    lock.lock();
  }
}

std::vector<int64_t> ProgressBoard::heartbeats(const std::vector<int>& global_ranks) {
  std::vector<int64_t> counts;
  std::lock_guard<std::mutex> lock(store_mu_);
  for (int r : global_ranks) counts.push_back(store_.add(heartbeat_key(r), 0));  // adding 0 reads it
  return counts;
}

std::vector<int> ProgressBoard::stalled(const std::vector<int>& global_ranks) {
  const std::vector<int64_t> before = heartbeats(global_ranks);
  std::this_thread::sleep_for(4 * kHeartbeat);
  const std::vector<int64_t> after = heartbeats(global_ranks);
  std::vector<int> stopped;
  for (size_t i = 0; i < global_ranks.size(); ++i) {
    if (global_ranks[i] != rank_ && after[i] == before[i]) stopped.push_back(global_ranks[i]);
  }
  return stopped;
}

std::vector<int64_t> ProgressBoard::last_entered(const std::string& group, const std::vector<int>& global_ranks) {
  publish_dirty();
  std::this_thread::sleep_for(3 * kPeriod);
  std::vector<int64_t> result;
  std::lock_guard<std::mutex> lock(store_mu_);
  for (int r : global_ranks) {
    const std::string k = key(group, r);
    if (!store_.check({k})) {
      result.push_back(-1);
      continue;
    }
    result.push_back(parse_seq(k, store_.get(k)));
  }
  return result;
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  s << "]";
  return s.str();
}

namespace {

// "; on host A: ranks [2, 3]; on host B: ranks [4]" for ranks on other hosts than this one's, so
// that a host that went away is named with its ranks. Empty when they all share this host.
std::string hosts_of(ProgressBoard& board, const std::vector<int>& ranks) {
  const std::string here = ProgressBoard::this_host();
  std::vector<std::pair<std::string, std::vector<int>>> by_host;
  for (int r : ranks) {
    const std::string host = board.host_of(r);
    if (host.empty() || host == here) continue;
    auto same = [&](const auto& entry) { return entry.first == host; };
    auto it = std::find_if(by_host.begin(), by_host.end(), same);
    if (it == by_host.end()) by_host.push_back({host, {r}});
    else it->second.push_back(r);
  }
  std::ostringstream s;
  for (const auto& [host, on_it] : by_host) s << "; on host " << host << ": ranks " << format_ranks(on_it);
  return s.str();
}

}  // namespace

// Which members never entered collective `seq`, and which stopped making progress (their
// process no longer runs: SIGSTOP, a debugger, a frozen machine), from the progress board.
std::string describe_absent_and_stalled(ProgressBoard& board, const std::string& group,
                                        const std::vector<int>& global_ranks, int64_t seq) {
  std::ostringstream msg;
  try {
    std::vector<int64_t> last = board.last_entered(group, global_ranks);
    std::vector<int> absent;
    std::ostringstream detail;
    for (size_t i = 0; i < last.size(); ++i) {
      if (last[i] >= seq) continue;
      absent.push_back(global_ranks[i]);
      detail << (absent.size() > 1 ? ", " : "") << "rank " << global_ranks[i] << ": "
             << (last[i] < 0 ? std::string("none") : "#" + std::to_string(last[i]));
    }
    const std::vector<int> stalled = board.stalled(global_ranks);
    std::vector<int> stopped, silent, left;
    for (int r : stalled) {
      switch (board.fate(r)) {
        case ProgressBoard::Fate::kLeft:
        case ProgressBoard::Fate::kGone: left.push_back(r); break;
        case ProgressBoard::Fate::kStopped: stopped.push_back(r); break;
        case ProgressBoard::Fate::kSilent: silent.push_back(r); break;
      }
    }
    if (!absent.empty()) {
      msg << "; ranks that did not arrive: " << format_ranks(absent)
          << " (last collective they entered on this group: " << detail.str() << ")";
    }
    if (!stopped.empty()) {
      msg << "; ranks that stopped making progress: " << format_ranks(stopped)
          << " (their process is stopped, e.g. by SIGSTOP or a debugger)";
    }
    if (!silent.empty()) {
      msg << "; ranks that stopped making progress: " << format_ranks(silent) << " (their process published no "
          << "heartbeat for " << 4 * ProgressBoard::kHeartbeat.count() << " ms: stopped, e.g. by SIGSTOP or a "
          << "debugger, frozen, or cut off from this rank (a link or host down)" << hosts_of(board, silent) << ")";
    }
    if (!left.empty()) msg << "; ranks whose process has ended: " << format_ranks(left) << " (it exited or was killed)";
    if (absent.empty() && stalled.empty()) {
      msg << "; every rank entered it and is running, so the transfer itself failed: check that all ranks "
             "issue the same collectives with the same sizes";
    }
  } catch (const std::exception& e) {
    msg << "; could not ask the store which ranks arrived (" << e.what() << ")";
  }
  return msg.str();
}

}  // namespace comm
}  // namespace fsdp
