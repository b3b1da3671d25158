#include "flight_dumps.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>
#include <unistd.h>
#include <vector>

namespace fsdprun {
namespace fs = std::filesystem;

int64_t wall_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string flight_recorder_base_dir(const Options& opt, pid_t launcher) {
  if (!opt.flight_recorder_dir.empty()) return opt.flight_recorder_dir;
  if (!opt.log_dir.empty()) return opt.log_dir + "/flight_recorder";
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fsdprun-flight-" + std::to_string(launcher);
}

std::string flight_recorder_attempt_dir(const std::string& base, int attempt) {
  return base + "/attempt_" + std::to_string(attempt);
}

bool process_stopped(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');  // "pid (comm) state ...": comm may hold spaces
  return paren != std::string::npos && paren + 2 < stat.size() && (stat[paren + 2] == 'T' || stat[paren + 2] == 't');
}

bool catches_signal(pid_t pid, int signo) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("SigCgt:", 0) != 0) continue;
    const unsigned long long mask = std::strtoull(line.c_str() + 7, nullptr, 16);
    return (mask >> (signo - 1)) & 1ULL;
  }
  return false;
}

bool wait_for_dumps(const std::string& dir, int ranks, int64_t since_us, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int fresh = 0;
    for (const auto& d : read_flight_dumps(dir, nullptr)) fresh += d.dump_time_us >= since_us;
    if (fresh >= ranks) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string diagnose_failure(const std::string& dir, const std::map<int, RankStatus>& status, int world_size) {
  std::vector<std::string> problems;
  const std::vector<FlightDump> dumps = read_flight_dumps(dir, &problems);
  if (dumps.empty() && problems.empty()) return "";
  if (problems.empty() && !may_have_hung(dumps, status, world_size)) {
    return "flight recorder: no rank was inside a collective when the job ended (not a hang); dumps in " + dir;
  }
  return diagnose_dir(dir, status, world_size);
}

std::string diagnose_dir(const std::string& dir, const std::map<int, RankStatus>& status, int world_size) {
  std::vector<std::string> problems;
  const std::vector<FlightDump> dumps = read_flight_dumps(dir, &problems);
  std::string out = diagnose(dumps, status, world_size);
  for (const auto& p : problems) out += "\nflight recorder: could not read " + p;
  out += "\nflight recorder: dumps in " + dir;
  return out;
}

namespace {

std::string rank_dump_path(const std::string& dir, int rank) { return dir + "/rank_" + std::to_string(rank) + ".json"; }

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Written under a temporary name and renamed, so that a reader never sees half a dump.
void write_dump(const std::string& dir, int rank, const std::string& text) {
  fs::create_directories(dir);
  const std::string path = rank_dump_path(dir, rank);
  const std::string partial = path + ".from-peer." + std::to_string(getpid());
  {
    std::ofstream out(partial, std::ios::binary);
    out << text;
    if (!out) throw std::runtime_error("cannot write " + partial);
  }
  fs::rename(partial, path);
}

}  // namespace

std::string pack_node_dumps(const std::string& dir, const std::vector<int>& ranks,
                            const std::map<int, RankStatus>& status) {
  nlohmann::json doc = nlohmann::json::array();
  for (int rank : ranks) {
    nlohmann::json r = {{"rank", rank}};
    if (auto text = read_text(rank_dump_path(dir, rank))) r["dump"] = *text;
    if (auto it = status.find(rank); it != status.end()) {
      r["exit"] = it->second.exit;
      r["stopped"] = it->second.stopped;
    }
    doc.push_back(std::move(r));
  }
  return doc.dump();
}

void unpack_node_dumps(const std::string& document, const std::string& dir, std::map<int, RankStatus>* status) {
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(document);
    for (const auto& r : doc) {
      const int rank = r.at("rank").get<int>();
      if (r.contains("exit")) (*status)[rank] = {r.at("exit").get<std::string>(), r.value("stopped", false)};
      if (r.contains("dump") && !fs::exists(rank_dump_path(dir, rank)))
        write_dump(dir, rank, r.at("dump").get<std::string>());
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("not a node's flight-recorder dumps: ") + e.what());
  }
}

namespace {

// The options the fsdprun `pid` was started with, from /proc/PID/cmdline.
std::optional<Options> options_of(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::string> args;
  std::string arg;
  for (char c : text.str()) {
    if (c != '\0') {
      arg += c;
      continue;
    }
    args.push_back(arg);
    arg.clear();
  }
  if (args.empty() || fs::path(args[0]).filename() != "fsdprun") return std::nullopt;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  ParseResult parsed = parse_options(static_cast<int>(argv.size()), argv.data());
  if (!parsed.ok) return std::nullopt;
  return parsed.options;
}

// The folder of the latest attempt under `base` ("" when there is none yet).
std::string latest_attempt_dir(const std::string& base) {
  for (int k = 1000; k >= 0; --k) {
    const std::string dir = flight_recorder_attempt_dir(base, k);
    if (fs::is_directory(dir)) return dir;
  }
  return "";
}

}  // namespace

int request_dumps(int pid) {
  const std::optional<Options> opt = options_of(pid);
  if (!opt) {
    std::cerr << "fsdprun: error: --dump " << pid << ": no fsdprun runs with that pid on this machine\n";
    return 1;
  }
  const std::string base = flight_recorder_base_dir(*opt, pid);
  const int64_t asked = wall_us();
  if (kill(pid, SIGUSR1) != 0) {
    std::cerr << "fsdprun: error: --dump " << pid << ": cannot signal it\n";
    return 1;
  }
  // The workers create the folder when they join the job; a job that is still starting has none.
  std::string dir;
  for (int i = 0; i < 100 && (dir = latest_attempt_dir(base)).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (dir.empty()) {
    std::cerr << "fsdprun: error: --dump " << pid << ": no dumps in " << base
              << " (have the workers called fsdp::init_process_group yet?)\n";
    return 1;
  }
  const bool all = wait_for_dumps(dir, opt->nproc_per_node, asked, 5000);
  std::cout << diagnose_dir(dir, {}, opt->world_size()) << "\n";
  if (!all) std::cout << "flight recorder: not every local worker wrote a dump within 5 s\n";
  return 0;
}

}  // namespace fsdprun
