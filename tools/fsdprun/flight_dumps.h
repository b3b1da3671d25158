// Where the workers' flight-recorder dumps go, asking for them, and reading them back into a
// diagnosis (flight_diagnosis.h) when a job fails or on request (SIGUSR1, fsdprun --dump).
#pragma once

#include "flight_diagnosis.h"
#include "options.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>
#include <sys/types.h>

namespace fsdprun {

// --flight-recorder-dir, else LOG_DIR/flight_recorder, else $TMPDIR/fsdprun-flight-<pid of fsdprun>.
std::string flight_recorder_base_dir(const Options& opt, pid_t launcher);
// The folder of attempt k's dumps (FSDP_FLIGHT_RECORDER_DIR of its workers).
std::string flight_recorder_attempt_dir(const std::string& base, int attempt);

// True when the process is stopped (state T or t in /proc/PID/stat: SIGSTOP, a debugger).
bool process_stopped(pid_t pid);

// True when the process has a handler for signo (SigCgt in /proc/PID/status).
bool catches_signal(pid_t pid, int signo);

// Waits up to timeout_ms until `ranks` dumps newer than `since_us` (wall clock) are in `dir`.
// Returns whether they all came.
bool wait_for_dumps(const std::string& dir, int ranks, int64_t since_us, int timeout_ms);

// The diagnosis of the dumps in `dir`, as lines to print (see diagnose()), with a last line
// naming the folder. Never throws: problems reading the dumps are lines of their own.
std::string diagnose_dir(const std::string& dir, const std::map<int, RankStatus>& status, int world_size);
// After a failed attempt: diagnose_dir's text when a rank may have hung; one line when every
// rank that dumped had completed each collective it entered (a config error, a NaN stop: not a
// hang); nothing when no rank dumped.
std::string diagnose_failure(const std::string& dir, const std::map<int, RankStatus>& status, int world_size);

// Several nodes: each node's fsdprun shares its ranks' dumps with the others through the agent
// store, so that every node diagnoses the whole job and keeps every rank's dump on its disk.
// The document holds, for each of `ranks` whose dump is in `dir`, the dump's text and what
// this fsdprun knows of the rank (status; ranks without a dump are listed with their status).
std::string pack_node_dumps(const std::string& dir, const std::vector<int>& ranks,
                            const std::map<int, RankStatus>& status);
// Writes the dumps of another node's document into `dir` as rank_R.json (unless that file is
// there already, as on a folder shared by the nodes) and adds its ranks' status to `status`.
// Throws std::runtime_error naming what is wrong with a malformed document.
void unpack_node_dumps(const std::string& document, const std::string& dir, std::map<int, RankStatus>* status);

// fsdprun --dump PID: sends SIGUSR1 to that fsdprun (it asks its workers for dumps and keeps
// running), waits for the dumps and prints the diagnosis. Returns the exit status: 0, or 1 when
// PID is not an fsdprun of this machine or no dump came.
int request_dumps(int pid);

// Wall-clock microseconds since the epoch (the dumps' clock).
int64_t wall_us();

}  // namespace fsdprun
