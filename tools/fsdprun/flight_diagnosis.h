// The diagnosis of a failed or hung job from the flight-recorder dumps of its ranks (the JSON
// files fsdp's flight recorder writes, one per rank: include/fsdp/flight_recorder.h).
//
// For each process group it finds the first collective that some rank entered and did not
// complete, and says who entered it, who never did (and what they did last), and what fsdprun
// knows of those ranks (exit status, stopped by SIGSTOP):
//   all_gather #57 of group 'world' (forward, module blocks.3): ranks 0,2,3 entered it 31.0 s
//   before the dumps; rank 1 never did — its last collective on this group was reduce_scatter
//   #56 (completed)
//   rank 1: last seen: backward of blocks.2; it dumped on signal SIGTERM; was killed by ...
// Pure functions of their inputs: no I/O except read_flight_dumps.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdprun {

struct FlightEntry {
  std::string group, op, dtype, state, phase, module;
  int64_t seq = 0, bytes = 0;
  int64_t enqueued_us = 0, started_us = 0, finished_us = 0;
};

struct FlightDump {
  int rank = -1;
  int64_t pid = 0;
  std::string reason;
  std::string first_failure;
  std::string last_phase, last_module;  // what the rank was doing when it dumped
  int64_t dump_time_us = 0;
  std::map<std::string, std::vector<int>> groups;  // name -> members (world ranks)
  std::vector<FlightEntry> entries;                // oldest first
  std::string path;                                // where it was read from
};

// Parses one dump. Throws std::runtime_error saying what is wrong with it.
FlightDump parse_flight_dump(const std::string& json_text);

// The dumps (rank_<R>.json) in `dir`, by rank; unreadable ones are described in `problems`.
std::vector<FlightDump> read_flight_dumps(const std::string& dir, std::vector<std::string>* problems);

// What fsdprun itself knows of a worker.
struct RankStatus {
  std::string exit;      // "exited with code 1", "was killed by signal SIGKILL (9)"; "" while running
  bool stopped = false;  // its process was stopped (state T: SIGSTOP, a debugger) when the job failed
};

// The diagnosis, one finding per line (no trailing newline). `world_size` <= 0: taken from the
// dumps' groups.
std::string diagnose(const std::vector<FlightDump>& dumps, const std::map<int, RankStatus>& status, int world_size);

// True when the dumps show a rank inside a collective some member has not completed, or a rank
// was stopped: the job may have hung, and diagnose() has something to say.
bool may_have_hung(const std::vector<FlightDump>& dumps, const std::map<int, RankStatus>& status, int world_size);

}  // namespace fsdprun
