#include "options.h"

#include "run_limits.h"

#include <CLI/CLI.hpp>

#include <iostream>
#include <random>
#include <sstream>

namespace fsdprun {
namespace {

// Thrown for a usage error found after CLI11 has parsed the options.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

const char* kFooter = R"(
Each worker gets torchrun's environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID and
TORCHELASTIC_USE_AGENT_STORE=True (the fsdprun of node 0 hosts a TCPStore on MASTER_PORT).
Console lines of workers are prefixed with "[rankN]:" (N = global rank). With --log-dir,
output goes to DIR/attempt_K/rank_N/{stdout,stderr}.log (and to the console with --tee).
Exit status: 0 when all workers succeed, 1 when the group failed (after all restarts),
2 for a usage error, 128+SIG when fsdprun was stopped by signal SIG.
Each worker gets FSDP_FLIGHT_RECORDER_DIR: when the group fails, fsdprun reads the ranks'
flight-recorder dumps there and prints which rank is stuck in which collective. SIGUSR1 to
fsdprun (or fsdprun --dump PID) asks every worker for a dump without stopping the job.)";

// CLI11 would print "Usage: fsdprun [OPTIONS]", hiding the program part.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: fsdprun [OPTIONS] [--] PROGRAM [ARGS...]\n";
  }
};

void add_options(CLI::App& app, Options& o) {
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node,
                 "Number of worker processes on this node (at most " + std::to_string(kMaxNprocPerNode) + ")")
      ->capture_default_str();
  app.add_option("--nnodes", o.nnodes, "Number of nodes")->capture_default_str();
  app.add_option("--node-rank,--node_rank", o.node_rank, "Rank of this node")->capture_default_str();
  app.add_option("--master-addr,--master_addr", o.master_addr, "Address of node 0 (hosts the store)")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", o.master_port, "Port of the store on node 0")->capture_default_str();
  app.add_flag("--standalone", o.standalone, "Single node: store on 127.0.0.1 (loopback only) on a free port");
  app.add_option("--max-restarts,--max_restarts", o.max_restarts, "Restarts of the worker group after a failure")
      ->capture_default_str();
  app.add_option("--log-dir,--log_dir", o.log_dir, "Write worker output to DIR/attempt_K/rank_N/{stdout,stderr}.log");
  app.add_flag("--tee", o.tee, "With --log-dir: also show worker output on the console");
  app.add_flag("--no-prefix,--no_prefix", o.no_prefix, "Do not prefix console lines with [rankN]:");
  app.add_option("--monitor-interval,--monitor_interval", o.monitor_interval_s,
                 "Seconds between polls of the store for failures on other nodes")
      ->capture_default_str();
  app.add_option("--stop-grace-seconds,--stop_grace_seconds", o.stop_grace_s,
                 "Seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  app.add_option("--join-timeout,--join_timeout", o.join_timeout_s,
                 "Seconds to wait for the agents of all nodes before each attempt")
      ->capture_default_str();
  app.add_option("--run-id,--run_id", o.run_id, "TORCHELASTIC_RUN_ID for the workers")->capture_default_str();
  app.add_option("--flight-recorder-dir,--flight_recorder_dir", o.flight_recorder_dir,
                 "Where workers write flight-recorder dumps, DIR/attempt_K/rank_N.json (default: "
                 "LOG_DIR/flight_recorder with --log-dir, else $TMPDIR/fsdprun-flight-PID)");
  app.add_option("--dump", o.dump_pid,
                 "Ask the running fsdprun PID (on this machine) for flight-recorder dumps of its "
                 "workers without stopping them, and print its diagnosis");
}

void require(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

template <typename T>
std::string got(const std::string& what, T value) {
  std::ostringstream s;
  s << what << " (got " << value << ")";
  return s.str();
}

void validate_sizes(const Options& o) {
  require(o.nproc_per_node >= 1, got("--nproc-per-node must be at least 1", o.nproc_per_node));
  require(o.nproc_per_node <= kMaxNprocPerNode,
          got("--nproc-per-node must be at most " + std::to_string(kMaxNprocPerNode), o.nproc_per_node));
  require(o.nnodes >= 1, got("--nnodes must be at least 1", o.nnodes));
  const long long world = static_cast<long long>(o.nnodes) * o.nproc_per_node;
  require(world <= kMaxWorldSize, "the world size (--nnodes x --nproc-per-node) must be at most " +
                                      std::to_string(kMaxWorldSize) + " (got " + std::to_string(o.nnodes) + " x " +
                                      std::to_string(o.nproc_per_node) + " = " + std::to_string(world) + ")");
}

void validate(const Options& o) {
  validate_sizes(o);
  require(o.node_rank >= 0 && o.node_rank < o.nnodes, "--node-rank must be in [0, --nnodes) (got node rank " +
                                                          std::to_string(o.node_rank) + " with " +
                                                          std::to_string(o.nnodes) + " nodes)");
  require(o.master_port >= 1 && o.master_port <= 65535, got("--master-port must be in 1..65535", o.master_port));
  require(!o.master_addr.empty(), "--master-addr must not be empty");
  require(!(o.standalone && o.nnodes > 1), "--standalone is single-node: it cannot be used with --nnodes > 1");
  require(o.max_restarts >= 0, got("--max-restarts must be at least 0", o.max_restarts));
  require(o.monitor_interval_s > 0 && o.monitor_interval_s <= kMaxIntervalS,
          got("--monitor-interval must be in (0, 3600] seconds", o.monitor_interval_s));
  require(o.stop_grace_s >= 0 && o.stop_grace_s <= kMaxIntervalS,
          got("--stop-grace-seconds must be in [0, 3600] seconds", o.stop_grace_s));
  require(o.join_timeout_s > 0 && o.join_timeout_s <= kMaxJoinTimeoutS,
          got("--join-timeout must be in (0, 604800] seconds (a week)", o.join_timeout_s));
  if (o.dump_pid != 0) {
    require(o.dump_pid > 0, got("--dump needs the pid of a running fsdprun", o.dump_pid));
    require(o.command.empty(), "--dump asks a running fsdprun for dumps: it takes no program to run");
    return;
  }
  require(!o.command.empty(), "missing the program to run (usage: fsdprun [OPTIONS] PROGRAM [ARGS...])");
}

// CLI11's prefix_command() stops at the first positional argument and leaves it and
// everything after it in remaining(); a leading "--" is kept there too. An unknown
// option also lands in remaining(), so a first word starting with '-' is an error.
std::vector<std::string> take_command(const CLI::App& app) {
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") {
    rest.erase(rest.begin());
  } else if (!rest.empty() && rest.front().size() > 1 && rest.front()[0] == '-') {
    throw UsageError("unknown option '" + rest.front() + "' (see fsdprun --help)");
  }
  return rest;
}

std::string random_run_id() {
  std::random_device rd;
  std::ostringstream s;
  s << std::hex << rd() << rd();
  return s.str();
}

}  // namespace

ParseResult parse_options(int argc, char** argv) {
  ParseResult result;
  Options& o = result.options;
  CLI::App app{"Starts and supervises distributed LibTorch workers (like torchrun).", "fsdprun"};
  app.formatter(std::make_shared<UsageFormatter>());
  app.footer(kFooter);
  app.prefix_command();
  add_options(app, o);
  try {
    app.parse(argc, argv);
    o.command = take_command(app);
    validate(o);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return result;  // ok=false, exit 0
  } catch (const CLI::ParseError& e) {
    std::cerr << "fsdprun: error: " << e.what() << " (see fsdprun --help)\n";
    result.exit_code = 2;
    return result;
  } catch (const UsageError& e) {
    std::cerr << "fsdprun: error: " << e.what() << "\n";
    result.exit_code = 2;
    return result;
  }
  if (o.standalone) {
    o.master_addr = "127.0.0.1";  // the port is picked by the agent store
    if (app.count("--run-id") == 0) o.run_id = random_run_id();
  }
  result.ok = true;
  return result;
}

}  // namespace fsdprun
