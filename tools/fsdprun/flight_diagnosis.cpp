#include "flight_diagnosis.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

namespace fsdprun {
namespace {

using nlohmann::json;

// Up to this many ranks the diagnosis has a line for each; above, only for those it names.
constexpr int kEveryRankUpTo = 8;
// A dump's reason (an error message) is cut to this many characters in the diagnosis.
constexpr size_t kReasonChars = 100;

std::string ranks_text(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? "," : "") << ranks[i];
  return s.str();
}

std::string rank_word(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + ranks_text(ranks);
}

std::string where(const std::string& phase, const std::string& module) {
  if (phase.empty()) return module.empty() ? "" : "module " + module;
  return module.empty() ? phase : phase + " of " + module;
}

std::string seconds_text(int64_t us) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1) << static_cast<double>(us) / 1e6 << " s";
  return s.str();
}

std::string op_text(const FlightEntry& e) { return e.op + " #" + std::to_string(e.seq); }

// One group's view from one rank's dump.
struct RankView {
  std::optional<FlightEntry> first_pending;  // lowest seq not completed
  std::optional<FlightEntry> last;           // highest seq
  int64_t oldest_seq = -1;                   // of the records kept (the ring may have wrapped)
  std::map<int64_t, FlightEntry> by_seq;
};

RankView view_of(const FlightDump& d, const std::string& group) {
  RankView v;
  for (const FlightEntry& e : d.entries) {
    if (e.group != group) continue;
    v.by_seq[e.seq] = e;
    if (v.oldest_seq < 0 || e.seq < v.oldest_seq) v.oldest_seq = e.seq;
    if (!v.last || e.seq > v.last->seq) v.last = e;
    if (e.state != "completed" && (!v.first_pending || e.seq < v.first_pending->seq)) v.first_pending = e;
  }
  return v;
}

// A collective some rank is stuck in.
struct Stuck {
  int64_t since_us = 0;
  std::string text;
  std::vector<int> absent;  // ranks that never entered it, or left no dump
};

std::string status_text(int rank, const std::map<int, RankStatus>& status) {
  auto it = status.find(rank);
  if (it == status.end()) return "";
  std::string s;
  if (it->second.stopped) s = "its process was stopped (SIGSTOP or a debugger), not dead";
  if (!it->second.exit.empty()) s += (s.empty() ? "" : "; it then ") + it->second.exit;
  return s;
}

bool is_stopped(int rank, const std::map<int, RankStatus>& status) {
  auto it = status.find(rank);
  return it != status.end() && it->second.stopped;
}

// Collective #s of `group`, which some member has not completed: who entered it, who got
// through it, who never reached it. nullopt when nobody is inside it.
std::optional<Stuck> stuck_at(const std::string& group, int64_t s, const std::vector<int>& members,
                              std::map<int, RankView>& views, const std::map<int, RankStatus>& status, int64_t ref_us,
                              bool report_anyway) {
  std::vector<int> entered, completed, never, no_dump, stopped_inside;
  std::set<std::string> ops;
  const FlightEntry* sample = nullptr;
  for (int r : members) {
    auto v = views.find(r);
    if (v == views.end()) {
      no_dump.push_back(r);
      continue;
    }
    auto e = v->second.by_seq.find(s);
    if (e != v->second.by_seq.end()) {
      if (e->second.state == "completed") {
        completed.push_back(r);
        continue;
      }
      entered.push_back(r);
      if (is_stopped(r, status)) stopped_inside.push_back(r);
      ops.insert(e->second.op);
      if (!sample || e->second.enqueued_us < sample->enqueued_us) sample = &e->second;
    } else if (!v->second.last || v->second.last->seq < s) {
      never.push_back(r);
    }  // else: its records start after #s (the ring wrapped), so it got past it
  }
  if (sample == nullptr) return std::nullopt;
  // A rank that died inside an op its peers completed is not what they wait for.
  if (never.empty() && no_dump.empty() && ops.size() == 1 && stopped_inside.empty() && !report_anyway)
    return std::nullopt;
  std::ostringstream out;
  out << sample->op << " #" << s << " of group '" << group << "'";
  const std::string ctx = where(sample->phase, sample->module);
  out << " (" << (ctx.empty() ? "" : ctx + ", ") << sample->bytes << " bytes" << (sample->dtype.empty() ? "" : " ")
      << sample->dtype << ")";
  out << ": " << rank_word(entered) << " entered it " << seconds_text(ref_us - sample->enqueued_us)
      << " before the dumps";
  if (!completed.empty()) out << "; " << rank_word(completed) << " completed it";
  if (ops.size() > 1) {
    out << "; but they disagree on what it is:";
    for (int r : entered) out << " rank " << r << " called " << views[r].by_seq[s].op << ";";
    out << " every rank must issue the same collectives in the same order";
  }
  for (int r : stopped_inside)
    out << "; rank " << r << " entered it but its process was stopped (SIGSTOP or a debugger): it cannot complete it";
  for (int r : never) {
    const RankView& v = views[r];
    out << "; rank " << r << " never did";
    if (v.last) {
      out << " \xe2\x80\x94 its last collective on this group was " << op_text(*v.last) << " (" << v.last->state << ")";
    } else {
      out << " \xe2\x80\x94 it issued no collective on this group";
    }
  }
  if (!no_dump.empty()) out << "; " << rank_word(no_dump) << " left no dump (killed before it could write one?)";
  Stuck st;
  st.since_us = sample->enqueued_us;
  st.text = out.str();
  st.absent = never;
  st.absent.insert(st.absent.end(), no_dump.begin(), no_dump.end());
  st.absent.insert(st.absent.end(), stopped_inside.begin(), stopped_inside.end());
  return st;
}

// The collectives of `group` the job is stuck in: each member's first one not completed, kept
// when someone is missing from it (or the ranks disagree on it, or a stopped rank is inside).
// If none qualifies, the lowest one, so that a pending op is never left unsaid.
std::vector<Stuck> stuck_in(const std::string& group, const std::vector<int>& members,
                            const std::map<int, const FlightDump*>& by_rank, const std::map<int, RankStatus>& status,
                            int64_t ref_us) {
  std::map<int, RankView> views;
  std::set<int64_t> first_pending;
  for (int r : members) {
    auto it = by_rank.find(r);
    if (it == by_rank.end()) continue;
    RankView v = view_of(*it->second, group);
    if (v.first_pending) first_pending.insert(v.first_pending->seq);
    views[r] = std::move(v);
  }
  std::vector<Stuck> out;
  for (int64_t s : first_pending) {
    if (auto st = stuck_at(group, s, members, views, status, ref_us, false)) out.push_back(std::move(*st));
  }
  if (out.empty() && !first_pending.empty()) {
    if (auto st = stuck_at(group, *first_pending.begin(), members, views, status, ref_us, true))
      out.push_back(std::move(*st));
  }
  return out;
}

}  // namespace

FlightDump parse_flight_dump(const std::string& json_text) {
  FlightDump d;
  try {
    const json j = json::parse(json_text);
    d.rank = j.at("rank").get<int>();
    d.pid = j.value("pid", int64_t{0});
    d.reason = j.value("reason", "");
    d.first_failure = j.value("first_failure", "");
    d.dump_time_us = j.value("dump_time_us", int64_t{0});
    if (j.contains("last_seen")) {
      d.last_phase = j["last_seen"].value("phase", "");
      d.last_module = j["last_seen"].value("module", "");
    }
    for (const auto& g : j.value("groups", json::array()))
      d.groups[g.at("name").get<std::string>()] = g.at("ranks").get<std::vector<int>>();
    for (const auto& e : j.at("entries")) {
      FlightEntry f;
      f.group = e.at("group").get<std::string>();
      f.op = e.at("op").get<std::string>();
      f.seq = e.at("seq").get<int64_t>();
      f.state = e.at("state").get<std::string>();
      f.bytes = e.value("bytes", int64_t{0});
      f.dtype = e.value("dtype", "");
      f.phase = e.value("phase", "");
      f.module = e.value("module", "");
      f.enqueued_us = e.value("enqueued_us", int64_t{0});
      f.started_us = e.value("started_us", int64_t{0});
      f.finished_us = e.value("finished_us", int64_t{0});
      d.entries.push_back(std::move(f));
    }
  } catch (const json::exception& e) {
    throw std::runtime_error(std::string("not a flight-recorder dump: ") + e.what());
  }
  return d;
}

std::vector<FlightDump> read_flight_dumps(const std::string& dir, std::vector<std::string>* problems) {
  std::vector<FlightDump> dumps;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename();
    if (name.rfind("rank_", 0) != 0 || entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    std::stringstream text;
    text << in.rdbuf();
    try {
      FlightDump d = parse_flight_dump(text.str());
      d.path = entry.path();
      dumps.push_back(std::move(d));
    } catch (const std::exception& e) {
      if (problems) problems->push_back(entry.path().string() + ": " + e.what());
    }
  }
  std::sort(dumps.begin(), dumps.end(), [](const FlightDump& a, const FlightDump& b) { return a.rank < b.rank; });
  return dumps;
}

namespace {

// The dumps indexed: by rank, each group's members, the latest dump time, the world size.
struct DumpIndex {
  std::map<int, const FlightDump*> by_rank;
  std::map<std::string, std::vector<int>> groups;
  int64_t ref_us = 0;
  int world_size = 0;
};

DumpIndex index_dumps(const std::vector<FlightDump>& dumps, int world_size) {
  DumpIndex x;
  x.world_size = world_size;
  for (const FlightDump& d : dumps) {
    x.by_rank[d.rank] = &d;
    x.ref_us = std::max(x.ref_us, d.dump_time_us);
    for (const auto& [name, ranks] : d.groups) x.groups[name] = ranks;
    for (const FlightEntry& e : d.entries) {
      auto& members = x.groups[e.group];
      if (!d.groups.count(e.group) && std::find(members.begin(), members.end(), d.rank) == members.end())
        members.push_back(d.rank);  // an older dump without the group table: its own ranks only
    }
    for (const auto& [name, ranks] : x.groups)
      for (int r : ranks) x.world_size = std::max(x.world_size, r + 1);
  }
  for (auto& [name, members] : x.groups) std::sort(members.begin(), members.end());
  return x;
}

// Every collective the job is stuck in, the oldest first.
std::vector<Stuck> stuck_collectives(const DumpIndex& x, const std::map<int, RankStatus>& status) {
  std::vector<Stuck> stuck;
  for (const auto& [name, members] : x.groups) {
    for (Stuck& s : stuck_in(name, members, x.by_rank, status, x.ref_us)) stuck.push_back(std::move(s));
  }
  std::sort(stuck.begin(), stuck.end(), [](const Stuck& a, const Stuck& b) { return a.since_us < b.since_us; });
  return stuck;
}

}  // namespace

bool may_have_hung(const std::vector<FlightDump>& dumps, const std::map<int, RankStatus>& status, int world_size) {
  for (const auto& [rank, st] : status) {
    if (st.stopped) return true;
  }
  return !stuck_collectives(index_dumps(dumps, world_size), status).empty();
}

std::string diagnose(const std::vector<FlightDump>& dumps, const std::map<int, RankStatus>& status, int world_size) {
  const DumpIndex x = index_dumps(dumps, world_size);
  const auto& by_rank = x.by_rank;
  world_size = x.world_size;
  std::vector<std::string> lines;
  std::vector<int> with_dump, without;
  for (int r = 0; r < world_size; ++r) (by_rank.count(r) ? with_dump : without).push_back(r);
  lines.push_back("flight recorder: dumps of " + (with_dump.empty() ? std::string("no rank") : rank_word(with_dump)) +
                  (without.empty() ? "" : "; none from " + rank_word(without)));

  const std::vector<Stuck> stuck = stuck_collectives(x, status);
  std::set<int> named;
  for (const Stuck& s : stuck) {
    lines.push_back(s.text);
    named.insert(s.absent.begin(), s.absent.end());
  }
  if (stuck.empty())
    lines.push_back("no rank that dumped was inside a collective: every recorded collective completed");
  // What is known of each rank that did not arrive, and of every rank fsdprun saw stopped.
  // Small jobs: every rank's line (the one that failed first is not always the one missing).
  for (const auto& [rank, st] : status)
    if (st.stopped || world_size <= kEveryRankUpTo) named.insert(rank);
  if (world_size <= kEveryRankUpTo)
    for (int r = 0; r < world_size; ++r) named.insert(r);
  for (int r : named) {
    std::string text = "rank " + std::to_string(r) + ":";
    auto d = by_rank.find(r);
    if (d != by_rank.end()) {
      const std::string ctx = where(d->second->last_phase, d->second->last_module);
      text += " last seen: " + (ctx.empty() ? std::string("before any FSDP hook") : ctx);
      std::string why = d->second->reason;
      if (why.rfind("collective failed", 0) == 0) why = "its own collective's failure";
      if (why.size() > kReasonChars) why = why.substr(0, kReasonChars) + "...";  // the worker printed it whole
      text += "; it dumped on " + why;
    }
    const std::string st = status_text(r, status);
    if (!st.empty()) text += (text.back() == ':' ? " " : "; ") + st;
    if (text.back() != ':') lines.push_back(text);
  }
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) out += (i ? "\n" : "") + lines[i];
  return out;
}

}  // namespace fsdprun
