// End-to-end tests of fsdprun: real fsdprun processes starting the test worker
// (test_worker.cpp). Every test uses its own directory and free ports, so several
// runs of the suite can share a machine.
#include "process_harness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

namespace launcher_test {
namespace {

using namespace process_test;

// The programs under test (paths from CMake).
const Program fsdprun(beside_this_program(FSDPRUN_BIN));
const Program test_worker(beside_this_program(TEST_WORKER_BIN));
const Program store_worker(beside_this_program(STORE_WORKER_BIN));

using Args = std::vector<std::string>;

Args with_worker(Args args, const Args& worker_args) {
  args.push_back(test_worker.path());
  args.insert(args.end(), worker_args.begin(), worker_args.end());
  return args;
}

std::string port_arg() { return std::to_string(free_port()); }

bool contains(const std::string& text, const std::string& piece) { return text.find(piece) != std::string::npos; }

#define EXPECT_CONTAINS(text, piece) \
  EXPECT_TRUE(contains(text, piece)) << "missing \"" << (piece) << "\" in:\n" << (text)

// Values of the pid_* files the test worker wrote in dir.
std::vector<pid_t> worker_pids(const std::string& dir) {
  std::vector<pid_t> pids;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename();
    if (name.rfind("pid_", 0) == 0 && name.find(".tmp") == std::string::npos)
      pids.push_back(std::atoi(read_file(entry.path()).c_str()));
  }
  return pids;
}

// ---------------------------------------------------------------- environment
class EnvContract : public ::testing::TestWithParam<int> {};

TEST_P(EnvContract, EachWorkerSeesTorchrunVariables) {
  const int nproc = GetParam();
  TempDir dir;
  const std::string port = port_arg();
  const auto r = fsdprun.run(with_worker({"--nproc-per-node", std::to_string(nproc), "--master-port", port, "--run-id",
                                          "job7", "--max-restarts", "3"},
                                         {"env", dir.path()}),
                             {{"OMP_NUM_THREADS", ""}});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_CONTAINS(r.err, "OMP_NUM_THREADS");  // the one-time note
  for (int rank = 0; rank < nproc; ++rank) {
    auto env = read_env_file(dir / ("env_" + std::to_string(rank) + "_0"));
    const std::string R = std::to_string(rank), N = std::to_string(nproc);
    EXPECT_EQ(env["RANK"], R);
    EXPECT_EQ(env["LOCAL_RANK"], R);
    EXPECT_EQ(env["WORLD_SIZE"], N);
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], N);
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(env["ROLE_RANK"], R);
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], N);
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["MASTER_PORT"], port);
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "3");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "job7");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "True");
    EXPECT_EQ(env["OMP_NUM_THREADS"], "1");
    EXPECT_EQ(env["STORE_REACHABLE"], "1");  // the agent store listens on MASTER_PORT
  }
}

INSTANTIATE_TEST_SUITE_P(Nproc, EnvContract, ::testing::Values(2, 3));

TEST(EnvContractExtra, KeepsUserOmpNumThreads) {
  TempDir dir;
  const auto r = fsdprun.run(with_worker({"--standalone", "--nproc_per_node", "2"}, {"env", dir.path()}),
                             {{"OMP_NUM_THREADS", "4"}});
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_FALSE(contains(r.err, "OMP_NUM_THREADS")) << r.err;
  EXPECT_EQ(read_env_file(dir / "env_1_0")["OMP_NUM_THREADS"], "4");
  EXPECT_NE(read_env_file(dir / "env_1_0")["TORCHELASTIC_RUN_ID"], "none");  // random with --standalone
}

// ---------------------------------------------------------------- failures
TEST(Failure, NonZeroExitStopsTheOthers) {
  TempDir dir, logs;
  const auto r = fsdprun.run(with_worker(
      {"--nproc-per-node", "3", "--master-port", port_arg(), "--stop-grace-seconds", "1", "--log-dir", logs.path()},
      {"fail", dir.path(), "1", "7"}));
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_CONTAINS(r.err, "worker failed: rank 1 (local_rank 1, pid ");
  EXPECT_CONTAINS(r.err, "exited with code 7");
  EXPECT_CONTAINS(r.err, logs / "attempt_0/rank_1/stderr.log");
  EXPECT_CONTAINS(read_file(logs / "attempt_0/rank_1/stderr.log"), "rank 1 is failing now");
  const auto pids = worker_pids(dir.path());
  EXPECT_EQ(pids.size(), 3u);
  EXPECT_TRUE(wait_gone(pids).empty());
}

TEST(Failure, KilledBySignalStopsTheOthers) {
  TempDir dir;
  const auto r = fsdprun.run(with_worker({"--nproc-per-node", "2", "--standalone", "--stop-grace-seconds", "1"},
                                         {"killself", dir.path(), "0"}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_CONTAINS(r.err, "worker failed: rank 0 (local_rank 0, pid ");
  EXPECT_CONTAINS(r.err, "was killed by signal SIGKILL (9)");
  EXPECT_TRUE(wait_gone(worker_pids(dir.path())).empty());
}

TEST(Failure, WorkerIgnoringSigtermIsKilledAfterGrace) {
  TempDir dir;
  const auto r = fsdprun.run(with_worker({"--nproc-per-node", "2", "--standalone", "--stop-grace-seconds", "0.5"},
                                         {"fail", dir.path(), "0", "3", "ignore-term"}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_LT(r.seconds, 10.0);
  EXPECT_CONTAINS(r.err, "exited with code 3");
  EXPECT_TRUE(wait_gone(worker_pids(dir.path())).empty());
}

TEST(Failure, ProgramNotFound) {
  const auto r = fsdprun.run({"--standalone", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_CONTAINS(r.err, "cannot execute '/nonexistent/program'");
}

// ---------------------------------------------------------------- restarts
std::string attempts_seen(const std::string& dir, int rank) {
  return read_file(dir + "/attempts_" + std::to_string(rank));
}

TEST(Restart, SucceedsOnThirdAttempt) {
  TempDir dir;
  const auto r = fsdprun.run(
      with_worker({"--nproc-per-node", "2", "--standalone", "--max-restarts", "2"}, {"restart", dir.path(), "0", "2"}));
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(attempts_seen(dir.path(), 0), "0\n1\n2\n");
  EXPECT_EQ(attempts_seen(dir.path(), 1), "0\n1\n2\n");
  EXPECT_CONTAINS(r.err, "restarting the worker group: restart 1 of 2 (TORCHELASTIC_RESTART_COUNT=1)");
  EXPECT_CONTAINS(r.err, "restarting the worker group: restart 2 of 2 (TORCHELASTIC_RESTART_COUNT=2)");
}

TEST(Restart, GivesUpAfterMaxRestarts) {
  TempDir dir;
  const auto r = fsdprun.run(with_worker({"--nproc-per-node", "2", "--standalone", "--max-restarts", "2"},
                                         {"restart", dir.path(), "1", "99"}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_EQ(attempts_seen(dir.path(), 1), "0\n1\n2\n");
  EXPECT_CONTAINS(r.err, "giving up after 2 restart(s)");
}

// ---------------------------------------------------------------- bad arguments
// fsdprun must refuse with exit code 2 and one line naming the problem, starting nothing
// (the worker would write files into dir).
void expect_usage_error(Args args, const std::string& message, bool with_program = true) {
  TempDir dir;
  if (with_program) args = with_worker(args, {"env", dir.path()});
  const auto r = fsdprun.run(args);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_CONTAINS(r.err, "fsdprun: error: ");
  EXPECT_CONTAINS(r.err, message);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(BadArguments, UnknownFlag) { expect_usage_error({"--bogus"}, "unknown option '--bogus'"); }
TEST(BadArguments, NprocZero) {
  expect_usage_error({"--nproc-per-node", "0"}, "--nproc-per-node must be at least 1 (got 0)");
}
TEST(BadArguments, PortOutOfRange) {
  expect_usage_error({"--master-port", "70000"}, "--master-port must be in 1..65535 (got 70000)");
}
TEST(BadArguments, DurationsAreBounded) {
  expect_usage_error({"--stop-grace-seconds", "1e308"},
                     "--stop-grace-seconds must be in [0, 3600] seconds (got 1e+308)");
  expect_usage_error({"--monitor-interval", "inf"}, "--monitor-interval must be in (0, 3600] seconds (got inf)");
  expect_usage_error({"--join-timeout", "1e9"}, "--join-timeout must be in (0, 604800] seconds (a week) (got 1e+09)");
}
TEST(BadArguments, PortNotANumber) { expect_usage_error({"--master-port", "abc"}, "--master-port = abc"); }
TEST(BadArguments, NodeRankNotBelowNnodes) {
  expect_usage_error({"--node-rank", "2", "--nnodes", "2"}, "--node-rank must be in [0, --nnodes)");
}
TEST(BadArguments, StandaloneWithSeveralNodes) {
  expect_usage_error({"--standalone", "--nnodes", "2"}, "--standalone");
}
TEST(BadArguments, NprocAboveTheLimit) {
  expect_usage_error({"--nproc-per-node", "15000"}, "--nproc-per-node must be at most 1024 (got 15000)");
}
TEST(BadArguments, WorldSizeAboveTheLimit) {
  expect_usage_error(
      {"--nnodes", "2000", "--nproc-per-node", "1000"},
      "the world size (--nnodes x --nproc-per-node) must be at most 1048576 (got 2000 x 1000 = 2000000)");
}
TEST(BadArguments, WorldSizeThatOverflowsAnInt) {
  expect_usage_error({"--nnodes", "2000000000", "--nproc-per-node", "1000"}, "= 2000000000000)");
}
TEST(BadArguments, MissingProgram) {
  expect_usage_error({"--nproc-per-node", "2"}, "missing the program to run", false);
}

// Two pipes per worker: 200 workers need more than a soft limit of 300 open files, which
// fsdprun raises (the hard limit stays).
TEST(Limits, RaisesTheSoftOpenFileLimitForManyWorkers) {
  TempDir dir;
  const std::string command = "ulimit -Sn 300 && exec " + fsdprun.path() + " --standalone --nproc-per-node 200 " +
                              test_worker.path() + " env " + dir.path();
  const auto r = Program("/bin/sh").run({"-c", command}, {}, 60);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(std::filesystem::exists(dir / "env_199_0"));
}

// ---------------------------------------------------------------- output
TEST(Output, ConsoleLinesArePrefixedWithTheRank) {
  TempDir dir;
  const auto r = fsdprun.run(with_worker({"--nproc-per-node", "2", "--standalone"}, {"env", dir.path()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  for (std::string rank : {"0", "1"}) {
    EXPECT_CONTAINS(r.out, "[rank" + rank + "]:hello from rank " + rank + "\n");
    EXPECT_CONTAINS(r.out, "[rank" + rank + "]:tail " + rank + "\n");  // unterminated last line
    EXPECT_CONTAINS(r.err, "[rank" + rank + "]:warning from rank " + rank + "\n");
  }
  EXPECT_FALSE(contains(r.out, "warning"));  // stderr lines stay on stderr
}

TEST(Output, NoPrefix) {
  TempDir dir;
  const auto r = fsdprun.run(with_worker({"--standalone", "--no-prefix"}, {"env", dir.path()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "hello from rank 0\ntail 0\n");
}

TEST(Output, LogDirWritesPerRankFiles) {
  TempDir dir, logs;
  const auto r = fsdprun.run(
      with_worker({"--nproc-per-node", "2", "--standalone", "--log-dir", logs.path()}, {"env", dir.path()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_EQ(r.out, "");  // without --tee nothing of the workers reaches the console
  EXPECT_FALSE(contains(r.err, "warning from rank"));
  for (std::string rank : {"0", "1"}) {
    EXPECT_EQ(read_file(logs / ("attempt_0/rank_" + rank + "/stdout.log")),
              "hello from rank " + rank + "\ntail " + rank);  // raw bytes, no prefix
    EXPECT_EQ(read_file(logs / ("attempt_0/rank_" + rank + "/stderr.log")), "warning from rank " + rank + "\n");
  }
}

TEST(Output, TeeAlsoEchoesToTheConsole) {
  TempDir dir, logs;
  const auto r = fsdprun.run(
      with_worker({"--nproc-per-node", "2", "--standalone", "--log-dir", logs.path(), "--tee"}, {"env", dir.path()}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_CONTAINS(r.out, "[rank1]:hello from rank 1\n");
  EXPECT_CONTAINS(r.out, "[rank1]:tail 1\n");
  EXPECT_CONTAINS(r.err, "[rank0]:warning from rank 0\n");
  EXPECT_EQ(read_file(logs / "attempt_0/rank_1/stdout.log"), "hello from rank 1\ntail 1");
}

// ---------------------------------------------------------------- signals
void expect_signal_stops_everything(int signo, bool workers_ignore_term) {
  TempDir dir;
  Args worker = {"sleep", dir.path()};
  if (workers_ignore_term) worker.push_back("ignore-term");
  Process run =
      fsdprun.start(with_worker({"--nproc-per-node", "2", "--standalone", "--stop-grace-seconds", "0.5"}, worker));
  ASSERT_TRUE(wait_for_file(dir / "pid_0_0"));
  ASSERT_TRUE(wait_for_file(dir / "pid_1_0"));
  const auto pids = worker_pids(dir.path());
  const double sent = now_seconds();
  kill(run.pid(), signo);
  const auto r = run.wait(30);
  EXPECT_FALSE(r.timed_out) << describe(r);
  EXPECT_FALSE(r.signaled) << describe(r);
  EXPECT_EQ(r.exit_code, 128 + signo) << describe(r);
  EXPECT_LT(now_seconds() - sent, 10.0);
  EXPECT_EQ(pids.size(), 2u);
  EXPECT_TRUE(wait_gone(pids, 2).empty()) << "orphaned workers remain";
}

TEST(Signals, SigtermStopsWorkersAndExits) { expect_signal_stops_everything(SIGTERM, false); }
TEST(Signals, SigintStopsWorkersAndExits) { expect_signal_stops_everything(SIGINT, false); }
TEST(Signals, SigtermEscalatesToSigkill) { expect_signal_stops_everything(SIGTERM, true); }

// Starting many workers takes a while (each is a fork of fsdprun, a few ms with LibTorch
// mapped); a SIGTERM in the middle stops the ones started and starts no more.
TEST(Signals, SigtermWhileStartingWorkers) {
  TempDir dir;
  const int nproc = 400;
  Process run = fsdprun.start(with_worker(
      {"--nproc-per-node", std::to_string(nproc), "--standalone", "--stop-grace-seconds", "1"}, {"sleep", dir.path()}));
  ASSERT_TRUE(wait_for_file(dir / "pid_0_0"));
  const double sent = now_seconds();
  kill(run.pid(), SIGTERM);
  const auto r = run.wait(60);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << describe(r);
  EXPECT_LT(now_seconds() - sent, 10.0) << describe(r);
  EXPECT_CONTAINS(r.err, "received SIGTERM while starting the workers of attempt 0 (");
  EXPECT_CONTAINS(r.err, " of 400 started): stopping them (SIGKILL after 1s)");
  const auto pids = worker_pids(dir.path());
  EXPECT_LT(pids.size(), static_cast<std::size_t>(nproc));
  EXPECT_TRUE(wait_gone(pids, 5).empty()) << "orphaned workers remain";
}

// ---------------------------------------------------------------- loopback store
bool is_loopback(const std::string& hex) {
  return hex == "0100007F" ||                          // 127.0.0.1
         hex == "0000000000000000FFFF00000100007F" ||  // ::ffff:127.0.0.1
         hex == "00000000000000000000000001000000";    // ::1
}

bool is_wildcard(const std::string& hex) { return hex.find_first_not_of('0') == std::string::npos; }

TEST(AgentStore, StandaloneListensOnLoopbackOnly) {
  TempDir dir;
  Process run = fsdprun.start(with_worker({"--standalone"}, {"port", dir.path()}));
  ASSERT_TRUE(wait_for_file(dir / "port"));
  const int port = std::stoi(read_file(dir / "port"));
  const auto addresses = listen_addresses(port);
  ASSERT_FALSE(addresses.empty()) << "nothing listens on port " << port;
  for (const auto& a : addresses) EXPECT_TRUE(is_loopback(a)) << "store listens on " << a;
  EXPECT_TRUE(can_connect(port));
  kill(run.pid(), SIGTERM);
  EXPECT_EQ(run.wait(30).exit_code, 128 + SIGTERM);
}

// Without --standalone the store listens where --master-addr says, where the other nodes look
// for it (the default, 127.0.0.1, is loopback), and nowhere else.
TEST(AgentStore, StoreListensOnTheMasterAddressOnly) {
  TempDir dir;
  const int port = free_port();
  Process run = fsdprun.start(with_worker({"--master-port", std::to_string(port)}, {"port", dir.path()}));
  ASSERT_TRUE(wait_for_file(dir / "port"));
  const auto addresses = listen_addresses(port);
  ASSERT_FALSE(addresses.empty());
  for (const auto& a : addresses) EXPECT_TRUE(is_loopback(a)) << "store listens on " << a;
  kill(run.pid(), SIGTERM);
  EXPECT_EQ(run.wait(30).exit_code, 128 + SIGTERM);
}

// The control case: a --master-addr that is not this host's (here a documentation-only address,
// RFC 5737) cannot be bound, so the store listens on every address of the port, and the check
// above does see a wildcard listener.
TEST(AgentStore, AMasterAddressNotOfThisHostListensOnAllAddresses) {
  TempDir dir;
  const int port = free_port();
  Process run = fsdprun.start(
      with_worker({"--master-addr", "192.0.2.1", "--master-port", std::to_string(port)}, {"port", dir.path()}));
  ASSERT_TRUE(wait_for_file(dir / "port"));
  const auto addresses = listen_addresses(port);
  ASSERT_FALSE(addresses.empty());
  for (const auto& a : addresses) EXPECT_TRUE(is_wildcard(a)) << "store listens on " << a;
  kill(run.pid(), SIGTERM);
  EXPECT_EQ(run.wait(30).exit_code, 128 + SIGTERM);
}

TEST(AgentStore, PortInUseIsOneClearError) {
  const int port = free_port();
  PortHolder holder(port);
  ASSERT_TRUE(holder.ok());
  TempDir dir;
  const auto r = fsdprun.run(with_worker({"--master-port", std::to_string(port)}, {"env", dir.path()}));
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_EQ(r.err, "fsdprun: error: cannot host the agent store on port " + std::to_string(port) +
                       ": the port is already in use (by another fsdprun or another program); "
                       "choose a free --master-port, or use --standalone on a single node\n");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));  // no worker started
}

// ---------------------------------------------------------------- a stalled or lying store client
// The store's wire format: a request is a command byte, then each string as a little-endian
// 64-bit length and its bytes. SET is command 1: key, then value.
std::string store_string_header(uint64_t length) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((length >> (8 * i)) & 0xFF);
  return out;
}
// The first bytes of a SET whose 16-byte key never arrives, from a client that then holds the
// connection.
const std::string kHalfARequest = std::string(1, '\x01') + store_string_header(16) + "k";
// No store wait is involved in what the stall tests time: anything near a second is a stall.
constexpr double kPromptS = 4.0;

void touch(const std::string& path) { std::ofstream(path) << "\n"; }

// Resident memory of a process, in MiB (from /proc/PID/status).
double rss_mib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return -1;
}

// With the store stalled, a SIGKILLed worker is noticed at once: the agent's supervision
// never waits for the store (and, on one node, never talks to it).
TEST(StoreStall, WorkerDeathIsNoticedAtOnce) {
  TempDir dir;
  const int port = free_port();
  Process run = fsdprun.start(
      with_worker({"--nproc-per-node", "2", "--master-port", std::to_string(port), "--stop-grace-seconds", "1"},
                  {"killwhen", dir.path(), "0", "go"}));
  ASSERT_TRUE(wait_for_file(dir / "pid_0_0"));
  ASSERT_TRUE(wait_for_file(dir / "pid_1_0"));
  HeldConnection stall(port, kHalfARequest);
  ASSERT_TRUE(stall.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double go = now_seconds();
  touch(dir / "go");
  const auto r = run.wait(60);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_CONTAINS(r.err, "worker failed: rank 0 (local_rank 0, pid ");
  EXPECT_CONTAINS(r.err, "was killed by signal SIGKILL (9)");
  EXPECT_LT(now_seconds() - go, kPromptS) << describe(r);
  EXPECT_TRUE(wait_gone(worker_pids(dir.path())).empty());
}

TEST(StoreStall, NormalRunExitsPromptly) {
  TempDir dir;
  const int port = free_port();
  Process run = fsdprun.start(
      with_worker({"--nproc-per-node", "2", "--master-port", std::to_string(port)}, {"exitwhen", dir.path(), "go"}));
  ASSERT_TRUE(wait_for_file(dir / "pid_1_0"));
  HeldConnection stall(port, kHalfARequest);
  ASSERT_TRUE(stall.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double go = now_seconds();
  touch(dir / "go");
  const auto r = run.wait(60);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_LT(now_seconds() - go, kPromptS) << describe(r);
}

// The store serves the workers' rendezvous while a client holds half a request.
TEST(StoreStall, AHalfSentRequestDelaysNoRendezvous) {
  TempDir dir;
  const int port = free_port();
  Process run =
      fsdprun.start({"--nproc-per-node", "2", "--master-port", std::to_string(port), store_worker.path(), dir.path()});
  ASSERT_TRUE(wait_for_file(dir / "ready_0", 30));
  ASSERT_TRUE(wait_for_file(dir / "ready_1", 30));
  HeldConnection stall(port, kHalfARequest);
  ASSERT_TRUE(stall.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double go = now_seconds();
  touch(dir / "go");
  const auto r = run.wait(60);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_LT(now_seconds() - go, kPromptS) << describe(r);
  EXPECT_TRUE(std::filesystem::exists(dir / "done_0"));
  EXPECT_TRUE(std::filesystem::exists(dir / "done_1"));
}

// A request that claims a 2 GiB key, or a 2 GiB value, closes that client before anything is
// reserved; fsdprun's memory stays where it was and the workers rendezvous as usual.
TEST(StoreStall, LengthsClaimedOnTheWireAreCapped) {
  TempDir dir;
  const int port = free_port();
  Process run =
      fsdprun.start({"--nproc-per-node", "2", "--master-port", std::to_string(port), store_worker.path(), dir.path()});
  ASSERT_TRUE(wait_for_file(dir / "ready_0", 30));
  ASSERT_TRUE(wait_for_file(dir / "ready_1", 30));
  const double baseline = rss_mib(run.pid());
  ASSERT_GT(baseline, 0);
  const std::string padding(64 << 10, 'x');  // what a client would send on after the header
  HeldConnection huge_key(port, std::string(1, '\x01') + store_string_header(uint64_t{2} << 30) + padding);
  HeldConnection huge_value(
      port, std::string(1, '\x01') + store_string_header(1) + "k" + store_string_header(uint64_t{2} << 30) + padding);
  ASSERT_TRUE(huge_key.ok());
  ASSERT_TRUE(huge_value.ok());
  EXPECT_TRUE(huge_key.wait_closed_by_server(5)) << "the store kept a client that claims a 2 GiB key";
  EXPECT_TRUE(huge_value.wait_closed_by_server(5)) << "the store kept a client that claims a 2 GiB value";
  EXPECT_LT(rss_mib(run.pid()) - baseline, 64.0) << "fsdprun's memory grew from " << baseline << " MiB";
  touch(dir / "go");
  const auto r = run.wait(60);
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_TRUE(std::filesystem::exists(dir / "done_1"));
}

// ---------------------------------------------------------------- two nodes
Args node_args(int node_rank, const std::string& port, Args extra = {}) {
  Args args = {"--nnodes",           "2",   "--node-rank",          std::to_string(node_rank),
               "--nproc-per-node",   "2",   "--master-port",        port,
               "--monitor-interval", "0.1", "--stop-grace-seconds", "1",
               "--join-timeout",     "20"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(TwoNodes, RanksZeroToThreeWithWorldSizeFour) {
  TempDir dir;
  const std::string port = port_arg();
  Process node1 = fsdprun.start(with_worker(node_args(1, port), {"env", dir.path()}));  // waits for node 0's store
  Process node0 = fsdprun.start(with_worker(node_args(0, port), {"env", dir.path()}));
  const auto r0 = node0.wait(30), r1 = node1.wait(30);
  ASSERT_EQ(r0.exit_code, 0) << describe(r0);
  ASSERT_EQ(r1.exit_code, 0) << describe(r1);
  for (int rank = 0; rank < 4; ++rank) {
    auto env = read_env_file(dir / ("env_" + std::to_string(rank) + "_0"));
    EXPECT_EQ(env["RANK"], std::to_string(rank));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(rank % 2));
    EXPECT_EQ(env["GROUP_RANK"], std::to_string(rank / 2));
    EXPECT_EQ(env["WORLD_SIZE"], "4");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env["MASTER_PORT"], port);
    EXPECT_EQ(env["STORE_REACHABLE"], "1");
  }
  EXPECT_CONTAINS(r1.out, "[rank3]:hello from rank 3\n");
}

TEST(TwoNodes, FailureOnOneNodeStopsTheOther) {
  TempDir dir;
  const std::string port = port_arg();
  Process node0 = fsdprun.start(with_worker(node_args(0, port), {"fail", dir.path(), "3", "5"}));
  Process node1 = fsdprun.start(with_worker(node_args(1, port), {"fail", dir.path(), "3", "5"}));
  const auto r0 = node0.wait(30), r1 = node1.wait(30);
  EXPECT_EQ(r0.exit_code, 1) << describe(r0);
  EXPECT_EQ(r1.exit_code, 1) << describe(r1);
  EXPECT_LT(r0.seconds, 10.0);
  EXPECT_CONTAINS(r1.err, "worker failed: rank 3 (local_rank 1, pid ");
  EXPECT_CONTAINS(r0.err, "failed on another node (node 1: rank 3");
  EXPECT_EQ(worker_pids(dir.path()).size(), 4u);
  EXPECT_TRUE(wait_gone(worker_pids(dir.path())).empty());
}

// With a client holding half a request, a failure on node 1 still stops node 0's workers
// promptly: the store serves the agents meanwhile. Node 1 stops its other worker without
// waiting for the store at all.
TEST(TwoNodes, FailureIsSharedDespiteAStalledStore) {
  TempDir dir;
  const int port = free_port();
  const std::string p = std::to_string(port);
  Process node0 = fsdprun.start(with_worker(node_args(0, p), {"killwhen", dir.path(), "3", "go"}));
  Process node1 = fsdprun.start(with_worker(node_args(1, p), {"killwhen", dir.path(), "3", "go"}));
  for (int rank = 0; rank < 4; ++rank) ASSERT_TRUE(wait_for_file(dir / ("pid_" + std::to_string(rank) + "_0")));
  const pid_t rank2 = std::atoi(read_file(dir / "pid_2_0").c_str());  // node 1's other worker
  HeldConnection stall(port, kHalfARequest);
  ASSERT_TRUE(stall.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double go = now_seconds();
  touch(dir / "go");
  EXPECT_TRUE(wait_gone({rank2}, kPromptS).empty()) << "node 1 waited for the store";
  const auto r1 = node1.wait(60), r0 = node0.wait(60);
  EXPECT_EQ(r0.exit_code, 1) << describe(r0);
  EXPECT_EQ(r1.exit_code, 1) << describe(r1);
  EXPECT_CONTAINS(r1.err, "worker failed: rank 3 (local_rank 1, pid ");
  EXPECT_CONTAINS(r0.err, "failed on another node (node 1: rank 3");
  EXPECT_LT(now_seconds() - go, 2 * kPromptS);
  EXPECT_TRUE(wait_gone(worker_pids(dir.path())).empty());
}

// Node 0 alone: it says it timed out waiting for node 1, and exits then. The wait is timed from
// the event that starts it, node 0's store taking connections, not from the process's start:
// loading LibTorch before that takes seconds more on a busy machine, and is no part of the
// join timeout.
TEST(TwoNodes, MissingNodeEndsTheRunAtTheJoinTimeout) {
  TempDir dir;
  const int port = free_port();
  Process node0 = fsdprun.start(with_worker(
      {"--nnodes", "2", "--master-port", std::to_string(port), "--join-timeout", "2"}, {"env", dir.path()}));
  const double give_up = now_seconds() + 60;
  while (!can_connect(port) && now_seconds() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const double store_up = now_seconds();
  const auto r = node0.wait(60);
  EXPECT_EQ(r.exit_code, 1) << describe(r);
  EXPECT_CONTAINS(r.err,
                  "error: timed out after 2s waiting for the fsdprun of all 2 nodes to join attempt 0 (1 joined; "
                  "never joined: node 1; see --join-timeout)");
  EXPECT_LT(now_seconds() - store_up, 2 + 5.0) << describe(r);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(TwoNodes, RestartIsCoordinated) {
  TempDir dir;
  const std::string port = port_arg();
  const Args worker = {"restart", dir.path(), "3", "1"};
  Process node0 = fsdprun.start(with_worker(node_args(0, port, {"--max-restarts", "1"}), worker));
  Process node1 = fsdprun.start(with_worker(node_args(1, port, {"--max-restarts", "1"}), worker));
  const auto r0 = node0.wait(30), r1 = node1.wait(30);
  EXPECT_EQ(r0.exit_code, 0) << describe(r0);
  EXPECT_EQ(r1.exit_code, 0) << describe(r1);
  for (int rank = 0; rank < 4; ++rank) EXPECT_EQ(attempts_seen(dir.path(), rank), "0\n1\n") << "rank " << rank;
}

}  // namespace
}  // namespace launcher_test
