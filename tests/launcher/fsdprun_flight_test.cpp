// fsdprun and the flight recorder: the diagnosis of hand-made dumps, and real jobs (the FSDP
// program flight_worker.cpp under fsdprun) with one faulty rank: one that skips a collective,
// one stopped by SIGSTOP, one that raises mid-backward. Each job must end within the collective
// timeout, with dumps on disk and a diagnosis naming the rank and the op. Plus fsdprun --dump.
#include "flight_diagnosis.h"
#include "process_harness.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <thread>

namespace {

using namespace process_test;
using fsdprun::diagnose;
using fsdprun::FlightDump;
using fsdprun::FlightEntry;
using fsdprun::may_have_hung;
using fsdprun::RankStatus;

const Program fsdprun_bin(beside_this_program(FSDPRUN_BIN));
const Program flight_worker(beside_this_program(FLIGHT_WORKER_BIN));

bool contains(const std::string& text, const std::string& piece) { return text.find(piece) != std::string::npos; }
#define EXPECT_CONTAINS(text, piece) \
  EXPECT_TRUE(contains(text, piece)) << "missing \"" << (piece) << "\" in:\n" << (text)

// ---------------------------------------------------------------- diagnosis of hand-made dumps

constexpr int64_t kT0 = 1700000000000000;  // an arbitrary wall-clock origin, microseconds

FlightEntry entry(const std::string& op, int64_t seq, const std::string& state, const std::string& phase,
                  const std::string& module, int64_t enqueued_s) {
  FlightEntry e;
  e.group = "dp";
  e.op = op;
  e.seq = seq;
  e.state = state;
  e.phase = phase;
  e.module = module;
  e.bytes = 4096;
  e.dtype = "Float";
  e.enqueued_us = kT0 + enqueued_s * 1000000;
  return e;
}

FlightDump dump_of(int rank, std::vector<FlightEntry> entries, const std::string& phase, const std::string& module) {
  FlightDump d;
  d.rank = rank;
  d.reason = "signal SIGTERM";
  d.groups["dp"] = {0, 1, 2, 3};
  d.entries = std::move(entries);
  d.last_phase = phase;
  d.last_module = module;
  d.dump_time_us = kT0 + 100 * 1000000;
  return d;
}

TEST(FlightDiagnosis, NamesTheRankThatNeverEnteredAndWhatItDidLast) {
  std::vector<FlightDump> dumps;
  for (int r : {0, 2, 3}) {
    dumps.push_back(dump_of(r,
                            {entry("reduce_scatter", 56, "completed", "post-backward", "blocks.2", 60),
                             entry("all_gather", 57, "started", "forward", "blocks.3", 69)},
                            "forward", "blocks.3"));
  }
  dumps.push_back(
      dump_of(1, {entry("reduce_scatter", 56, "completed", "post-backward", "blocks.2", 60)}, "backward", "blocks.1"));
  std::map<int, RankStatus> status;
  status[1].exit = "was killed by signal SIGTERM (15)";
  const std::string text = diagnose(dumps, status, 4);
  EXPECT_CONTAINS(text, "flight recorder: dumps of ranks 0,1,2,3");
  EXPECT_CONTAINS(text,
                  "all_gather #57 of group 'dp' (forward of blocks.3, 4096 bytes Float): ranks 0,2,3 entered it "
                  "31.0 s before the dumps; rank 1 never did \xe2\x80\x94 its last collective on this group was "
                  "reduce_scatter #56 (completed)");
  EXPECT_CONTAINS(text,
                  "rank 1: last seen: backward of blocks.1; it dumped on signal SIGTERM; was killed by signal "
                  "SIGTERM (15)");
}

TEST(FlightDiagnosis, RanksThatDisagreeOnTheOpAndRanksWithoutADump) {
  std::vector<FlightDump> dumps = {
      dump_of(0, {entry("all_gather", 7, "started", "forward", "a", 10)}, "forward", "a"),
      dump_of(1, {entry("barrier", 7, "started", "", "", 11)}, "", ""),
  };
  std::map<int, RankStatus> status;
  status[3].stopped = true;
  status[3].exit = "was killed by signal SIGKILL (9)";
  const std::string text = diagnose(dumps, status, 4);
  EXPECT_CONTAINS(text, "none from ranks 2,3");
  EXPECT_CONTAINS(text, "ranks 0,1 entered it");
  EXPECT_CONTAINS(text, "rank 0 called all_gather; rank 1 called barrier;");
  EXPECT_CONTAINS(text, "ranks 2,3 left no dump");
  EXPECT_CONTAINS(text,
                  "rank 3: its process was stopped (SIGSTOP or a debugger), not dead; it then was killed by "
                  "signal SIGKILL (9)");
}

TEST(FlightDiagnosis, NothingPendingAndTheFirstPendingOpPerGroup) {
  std::vector<FlightDump> dumps = {dump_of(0, {entry("all_gather", 1, "completed", "forward", "a", 1)}, "", ""),
                                   dump_of(1, {entry("all_gather", 1, "completed", "forward", "a", 1)}, "", "")};
  for (auto& d : dumps) d.groups["dp"] = {0, 1};
  EXPECT_CONTAINS(diagnose(dumps, {}, 2), "no rank that dumped was inside a collective");
  EXPECT_FALSE(may_have_hung(dumps, {}, 2));
  std::map<int, RankStatus> one_stopped;
  one_stopped[1].stopped = true;
  EXPECT_TRUE(may_have_hung(dumps, one_stopped, 2));

  // Rank 0 failed #2 and never ran #3: #2 is the one to report, not the later ones.
  dumps[0].entries.push_back(entry("reduce_scatter", 2, "failed", "post-backward", "a", 2));
  dumps[0].entries.push_back(entry("all_gather", 3, "enqueued", "forward", "a", 3));
  const std::string text = diagnose(dumps, {}, 2);
  EXPECT_CONTAINS(text, "reduce_scatter #2 of group 'dp' (post-backward of a, 4096 bytes Float): rank 0 entered it");
  EXPECT_CONTAINS(text,
                  "rank 1 never did \xe2\x80\x94 its last collective on this group was all_gather #1 (completed)");
  EXPECT_FALSE(contains(text, "#3")) << text;
}

TEST(FlightDiagnosis, ParsesTheLibrarysDumpFormat) {
  const std::string text = R"({"version": 1, "rank": 2, "pid": 77, "host": "h", "reason": "signal SIGUSR1",
    "dump_time_us": 5, "consistent": true, "first_failure": "", "last_seen": {"phase": "backward",
    "module": "blocks.0", "since_us": 4}, "capacity": 8, "total_recorded": 1,
    "groups": [{"name": "world", "ranks": [0, 1, 2]}],
    "entries": [{"id": 0, "group": "world", "op": "barrier", "seq": 0, "bytes": 0, "dtype": "",
                 "state": "completed", "enqueued_us": 1, "started_us": 2, "finished_us": 3,
                 "phase": "", "module": ""}]})";
  const FlightDump d = fsdprun::parse_flight_dump(text);
  EXPECT_EQ(d.rank, 2);
  EXPECT_EQ(d.pid, 77);
  EXPECT_EQ(d.last_phase, "backward");
  EXPECT_EQ(d.groups.at("world"), (std::vector<int>{0, 1, 2}));
  ASSERT_EQ(d.entries.size(), 1u);
  EXPECT_EQ(d.entries[0].op, "barrier");
  EXPECT_EQ(d.entries[0].finished_us, 3);
  EXPECT_THROW(fsdprun::parse_flight_dump("{\"rank\": 1}"), std::runtime_error);
  EXPECT_THROW(fsdprun::parse_flight_dump("not json"), std::runtime_error);
}

// ---------------------------------------------------------------- real jobs

constexpr double kTimeoutS = 3.0;  // the collective timeout of the jobs below

RunResult run_job(const std::string& mode, const TempDir& dir, const Env& env = {}) {
  Env e = env;
  e["FSDP_COLLECTIVE_TIMEOUT_MS"] = std::to_string(static_cast<int>(kTimeoutS * 1000));
  e["OMP_NUM_THREADS"] = "1";
  return fsdprun_bin.run({"--standalone", "--nproc-per-node", "2", "--stop-grace-seconds", "5", "--flight-recorder-dir",
                          dir / "flight", flight_worker.path(), mode, dir.path()},
                         e, 90);
}

// Both ranks' dumps are on disk and name this job's collectives.
void expect_dumps(const TempDir& dir) {
  for (int r : {0, 1}) {
    const std::string path = dir / ("flight/attempt_0/rank_" + std::to_string(r) + ".json");
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    const auto j = nlohmann::json::parse(read_file(path));
    EXPECT_EQ(j["rank"], r);
    EXPECT_GT(j["entries"].size(), 4u);
  }
}

TEST(FlightJobs, ARankThatSkipsACollectiveIsNamedWithTheOpItNeverEntered) {
  TempDir dir;
  const RunResult r = run_job("skip", dir);
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_LT(r.seconds, 60) << describe(r);
  EXPECT_CONTAINS(r.err, "fsdprun: flight recorder: dumps of ranks 0,1");
  EXPECT_CONTAINS(r.err, "rank 0 entered it");
  EXPECT_CONTAINS(r.err, "rank 1 never did \xe2\x80\x94 its last collective on this group was reduce_scatter #");
  EXPECT_TRUE(contains(r.err, "all_gather #") && contains(r.err, "(forward of blocks.0")) << r.err;
  expect_dumps(dir);
}

TEST(FlightJobs, ARankStoppedBySigstopIsNamedAndTheJobEnds) {
  TempDir dir;
  const RunResult r = run_job("stop", dir);
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_LT(r.seconds, 60) << describe(r);
  EXPECT_CONTAINS(r.err, "rank 1 (pid ");
  EXPECT_CONTAINS(r.err, "is stopped (SIGSTOP or a debugger), not dead");
  // It stops in a gradient hook that runs after blocks.2's reduce-scatter and the backward
  // prefetch of blocks.1 were issued. Which of the two is first left incomplete depends on
  // whether the communication thread finished them before the process stopped; if it finished
  // both, rank 0 waits in blocks.1's reduce-scatter, which rank 1 never issued.
  EXPECT_TRUE(contains(r.err, "reduce_scatter #") || contains(r.err, "(backward of blocks.1")) << r.err;
  EXPECT_TRUE(contains(r.err,
                       "rank 1 entered it but its process was stopped (SIGSTOP or a debugger): it cannot "
                       "complete it") ||
              contains(r.err, "rank 1 never did"))
      << r.err;
  // Continued so that it can dump, rank 1's stopped thread returns from its gradient hook and may
  // reach the next post-backward before the dump on SIGTERM is written: in backward either way.
  EXPECT_TRUE(contains(r.err, "rank 1: last seen: backward of blocks.") ||
              contains(r.err, "rank 1: last seen: post-backward of blocks."))
      << r.err;
  EXPECT_CONTAINS(r.err, "its process was stopped (SIGSTOP or a debugger), not dead");
  expect_dumps(dir);
}

TEST(FlightJobs, ARankThatRaisesMidBackwardIsNamedWithWhereItWas) {
  TempDir dir;
  const RunResult r = run_job("raise", dir);
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_LT(r.seconds, 60) << describe(r);
  EXPECT_CONTAINS(r.err, "rank 1 fails in backward");
  EXPECT_CONTAINS(r.err, "rank 0 entered it");
  EXPECT_CONTAINS(r.err, "rank 1 never did");
  // Its hook runs after the pre-backward of blocks.1 (both are on blocks.2's input).
  EXPECT_CONTAINS(r.err, "rank 1: last seen: backward of blocks.1; it dumped on signal SIGABRT");
  expect_dumps(dir);
}

// Every rank stops with an error between collectives: not a hang, so fsdprun prints no
// diagnosis (at most one line saying so).
TEST(FlightJobs, AnErrorThatIsNoHangGetsNoDiagnosis) {
  TempDir dir;
  const RunResult r = run_job("exit", dir);
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_CONTAINS(r.err, "stops: bad input");
  EXPECT_EQ(r.err.find("flight recorder: dumps of"), std::string::npos) << describe(r);
  EXPECT_EQ(r.err.find("no rank that dumped"), std::string::npos) << describe(r);
}

// Two nodes (two fsdprun on this machine, each with a folder of its own, as on two machines):
// each node's diagnosis needs the other node's dump, which the agents share through the store.
TEST(FlightJobs, TwoNodesEachDiagnoseTheWholeJobWithTheOtherNodesDumps) {
  TempDir dir;
  const std::string port = std::to_string(free_port());
  Env e{{"FSDP_COLLECTIVE_TIMEOUT_MS", std::to_string(static_cast<int>(kTimeoutS * 1000))}, {"OMP_NUM_THREADS", "1"}};
  auto node = [&](int n) {
    return fsdprun_bin.start(
        {"--nnodes", "2", "--node-rank", std::to_string(n), "--nproc-per-node", "1", "--master-port", port,
         "--monitor-interval", "0.2", "--stop-grace-seconds", "5", "--join-timeout", "60", "--flight-recorder-dir",
         dir / ("flight_node" + std::to_string(n)), flight_worker.path(), "skip", dir.path()},
        e);
  };
  Process node0 = node(0), node1 = node(1);
  const RunResult r0 = node0.wait(90), r1 = node1.wait(90);
  for (const RunResult* r : {&r0, &r1}) {
    EXPECT_FALSE(r->timed_out) << describe(*r);
    EXPECT_EQ(r->exit_code, 1) << describe(*r);
    EXPECT_CONTAINS(r->err, "fsdprun: flight recorder: dumps of ranks 0,1");
    EXPECT_CONTAINS(r->err, "rank 0 entered it");
    EXPECT_CONTAINS(r->err, "rank 1 never did \xe2\x80\x94 its last collective on this group was reduce_scatter #");
  }
  for (int n : {0, 1}) {
    for (int rank : {0, 1}) {
      const std::string path =
          dir / ("flight_node" + std::to_string(n) + "/attempt_0/rank_" + std::to_string(rank) + ".json");
      ASSERT_TRUE(std::filesystem::exists(path)) << path;
      EXPECT_EQ(nlohmann::json::parse(read_file(path))["rank"], rank);
    }
  }
}

TEST(FlightJobs, DumpAsksARunningJobWithoutStoppingIt) {
  TempDir dir;
  Process job = fsdprun_bin.start({"--standalone", "--nproc-per-node", "2", "--flight-recorder-dir", dir / "flight",
                                   flight_worker.path(), "run", dir.path()},
                                  {{"OMP_NUM_THREADS", "1"}});
  ASSERT_TRUE(wait_for_file(dir / "pid_0", 60) && wait_for_file(dir / "pid_1", 60));
  const RunResult asked = fsdprun_bin.run({"--dump", std::to_string(job.pid())}, {}, 30);
  EXPECT_EQ(asked.exit_code, 0) << describe(asked);
  EXPECT_CONTAINS(asked.out, "flight recorder: dumps of ranks 0,1");
  EXPECT_CONTAINS(asked.out, "flight recorder: dumps in " + dir / "flight/attempt_0");
  for (int r : {0, 1}) {
    const auto j = nlohmann::json::parse(read_file(dir / ("flight/attempt_0/rank_" + std::to_string(r) + ".json")));
    EXPECT_EQ(j["reason"], "signal SIGUSR1");
  }
  const RunResult done = job.wait(120);
  EXPECT_EQ(done.exit_code, 0) << describe(done);  // the job went on to the end
  EXPECT_CONTAINS(done.err, "SIGUSR1: flight-recorder snapshot of the running job (it goes on)");
  EXPECT_CONTAINS(done.out, "rank 1 done");
}

TEST(FlightJobs, DumpOfAPidThatIsNoFsdprunFails) {
  const RunResult r = fsdprun_bin.run({"--dump", std::to_string(getpid())}, {}, 30);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_CONTAINS(r.err, "no fsdprun runs with that pid on this machine");
}

}  // namespace
