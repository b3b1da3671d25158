// Command-line options of fsdprun (the C++ counterpart of torchrun).
#pragma once

#include <string>
#include <vector>

namespace fsdprun {

struct Options {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  int max_restarts = 0;
  std::string log_dir;              // empty: worker output goes to the console only
  bool tee = false;                 // with log_dir: also echo to the console
  bool no_prefix = false;           // console lines without the "[rankN]:" prefix
  double monitor_interval_s = 0.5;  // how often the agent polls the store for peer failures
  double stop_grace_s = 3.0;        // SIGTERM -> SIGKILL delay when stopping workers
  double join_timeout_s = 600.0;    // how long agents wait for each other before an attempt
  std::string run_id = "none";
  // Where workers write flight-recorder dumps (FSDP_FLIGHT_RECORDER_DIR, one folder per
  // attempt); empty: see flight_recorder_base_dir().
  std::string flight_recorder_dir;
  int dump_pid = 0;                  // --dump PID: ask that running fsdprun for dumps instead of running a job
  std::vector<std::string> command;  // PROGRAM followed by its arguments

  int world_size() const { return nnodes * nproc_per_node; }
};

// Outcome of parsing: either options to run with, or an exit code to leave with
// (0 after --help, 2 after a usage error; the message has been printed already).
struct ParseResult {
  bool ok = false;
  int exit_code = 0;
  Options options;
};

ParseResult parse_options(int argc, char** argv);

}  // namespace fsdprun
