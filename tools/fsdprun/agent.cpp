#include "agent.h"

#include "flight_dumps.h"
#include "output.h"
#include "run_limits.h"
#include "signals.h"
#include "worker_env.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <map>
#include <optional>
#include <poll.h>
#include <sstream>
#include <unistd.h>

namespace fsdprun {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kBarrierPollMs = 50;      // store polling while waiting for other agents
constexpr double kExitBarrierS = 30.0;  // node 0 keeps the store up this long at most
// ... and stops waiting for an agent whose heartbeat has not moved for this long (gone, or cut off).
constexpr double kSilentAgentS = 5.0;
// After a failure, how much longer than a monitor interval plus the stop grace period an agent
// waits for the other nodes' flight-recorder dumps.
constexpr double kFlightGatherMarginS = 5.0;
// The supervision loop wakes for worker output, SIGCHLD, stop signals and news from the
// other nodes; this is only a safety net, should a wake-up ever be lost.
constexpr int kSupervisionWakeMs = 1000;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::string format_seconds(double s) {
  std::ostringstream out;
  out << s << "s";
  return out.str();
}

// "node 1" or "nodes 1, 3".
std::string node_list(const std::vector<int>& nodes) {
  std::ostringstream out;
  out << (nodes.size() == 1 ? "node " : "nodes ");
  for (size_t i = 0; i < nodes.size(); ++i) out << (i ? ", " : "") << nodes[i];
  return out.str();
}

// fsdprun's own messages: one write per line on stderr, never mixed with worker lines.
void say(const std::string& message) {
  const std::string line = "fsdprun: " + message + "\n";
  write_all(2, line.data(), line.size());
}

}  // namespace

int Agent::run() {
  try {
    raise_open_file_limit(opt_);
    flight_dir_ = flight_recorder_base_dir(opt_, getpid());
    store_ = std::make_unique<AgentStore>(opt_, [this] { return !stop_requested(); });
    if (several_nodes()) store_->register_agent(opt_.node_rank);
    for (int k = first_attempt();; ++k) {
      if (auto exit_code = conclude(k, attempt(k))) {
        // A default folder in $TMPDIR is for diagnosing failures only.
        if (*exit_code == 0 && opt_.flight_recorder_dir.empty() && opt_.log_dir.empty()) {
          std::error_code ignored;
          std::filesystem::remove_all(flight_dir_, ignored);
        }
        return *exit_code;
      }
    }
  } catch (const Interrupted&) {
    return 128 + stop_signal_;
  } catch (const std::exception& e) {
    say(std::string("error: ") + e.what());
    return 1;
  }
}

// What to do after attempt k: restart (nullopt) or leave with an exit code.
std::optional<int> Agent::conclude(int k, Outcome o) {
  if (o == Outcome::Interrupted || o == Outcome::Fatal) announce_stop(k, fatal_reason_);
  if (o == Outcome::Interrupted) {
    leave_store(/*wait_for_others=*/false);
    return 128 + stop_signal_;
  }
  if (o == Outcome::Failed && several_nodes()) {
    if (auto why = store_->shutdown()) {
      say("not restarting: " + *why);
      o = Outcome::Fatal;
    }
  }
  if (o == Outcome::Failed && k < opt_.max_restarts) {
    say("restarting the worker group: restart " + std::to_string(k + 1) + " of " + std::to_string(opt_.max_restarts) +
        " (TORCHELASTIC_RESTART_COUNT=" + std::to_string(k + 1) + ")");
    return std::nullopt;
  }
  if (o == Outcome::Failed && opt_.max_restarts == 0) say("the worker group failed; exiting with code 1");
  if (o == Outcome::Failed && opt_.max_restarts > 0)
    say("giving up after " + std::to_string(opt_.max_restarts) + " restart(s); exiting with code 1");
  leave_store(/*wait_for_others=*/true);
  return o == Outcome::Succeeded ? 0 : 1;
}

// An agent that starts while the job runs (its host came back, and fsdprun was started on it
// again) joins the attempt node 0 is in, or the next one if that attempt has failed already,
// with the restarts that node 0 has left. If its node already joined the attempt node 0 is in,
// that attempt lost this node (its ranks rendezvoused without the new workers and wait on the
// old ones), so the agent waits for node 0 to give it up and joins the next one: workers started
// into it could only fail to connect and be restarted with it. Which attempt a returning host
// joins thus depends on the store alone, never on whether node 0 noticed the loss first.
int Agent::first_attempt() {
  if (!several_nodes() || store_->is_host()) return 0;
  int k = store_->current_attempt();
  if (store_->has_joined(k, opt_.node_rank)) {
    k = wait_for_next_attempt(k);
  } else if (store_->failure(k)) {
    ++k;
  }
  if (k == 0) return 0;
  say("the job is past its first attempt: joining attempt " + std::to_string(k) + " (restart " + std::to_string(k) +
      " of " + std::to_string(opt_.max_restarts) + ")");
  if (k > opt_.max_restarts) {
    throw std::runtime_error("this node's --max-restarts (" + std::to_string(opt_.max_restarts) +
                             ") does not allow attempt " + std::to_string(k) +
                             ": give every node the same --max-restarts");
  }
  return k;
}

// Until node 0 has given attempt k up (it failed, or node 0 began a later one), within
// --join-timeout; returns the attempt to join. Stops when the job stops restarting.
int Agent::wait_for_next_attempt(int k) {
  say("node " + std::to_string(opt_.node_rank) + " already joined attempt " + std::to_string(k) +
      ", which lost it: waiting for node 0 to give that attempt up and start the next one");
  const auto deadline = Clock::now() + seconds(opt_.join_timeout_s);
  for (;;) {
    const int now = store_->current_attempt();
    if (now > k) return now;
    if (store_->failure(k)) return k + 1;
    if (auto why = store_->shutdown()) throw std::runtime_error("not rejoining the job: " + why.value());
    if (Clock::now() >= deadline) {
      throw std::runtime_error("node 0 is still in attempt " + std::to_string(k) + " after --join-timeout (" +
                               format_seconds(opt_.join_timeout_s) + "), although node " +
                               std::to_string(opt_.node_rank) +
                               " joined it before: is another fsdprun of this node still running it? Otherwise "
                               "raise --join-timeout above the time node 0's ranks take to notice a lost host "
                               "(their collective timeout)");
    }
    nap(kBarrierPollMs);
    if (stop_requested()) throw Interrupted();
  }
}

Agent::Outcome Agent::attempt(int k) {
  if (!several_nodes()) return run_workers(k);
  if (store_->is_host()) store_->begin_attempt(k);
  if (auto o = wait_for_agents(k)) return *o;
  const Outcome o = run_workers(k);
  if (o != Outcome::Succeeded) return o;
  store_->mark_done(k);
  return wait_for_peers(k);
}

// All agents join attempt k before any starts workers, so that the ranks of every
// node rendezvous within the same attempt (same TORCHELASTIC_RESTART_COUNT).
std::optional<Agent::Outcome> Agent::wait_for_agents(int k) {
  store_->join(k, opt_.node_rank);
  const auto deadline = Clock::now() + seconds(opt_.join_timeout_s);
  for (;;) {
    const int64_t joined = store_->joined(k);
    if (joined >= opt_.nnodes) break;
    if (auto why = store_->shutdown()) {
      say("stopping: " + *why);
      return Outcome::Fatal;
    }
    if (Clock::now() >= deadline) {
      fatal_reason_ =
          "the fsdprun of node " + std::to_string(opt_.node_rank) + " timed out waiting for the other nodes";
      say("error: timed out after " + format_seconds(opt_.join_timeout_s) + " waiting for the fsdprun of all " +
          std::to_string(opt_.nnodes) + " nodes to join attempt " + std::to_string(k) + " (" + std::to_string(joined) +
          " joined; never joined: " + node_list(store_->not_joined(k)) + "; see --join-timeout)");
      return Outcome::Fatal;
    }
    nap(kBarrierPollMs);
    if (stop_requested()) return Outcome::Interrupted;
  }
  return std::nullopt;
}

// Noticing that a local worker ended, and stopping the others, never waits for the
// store: the loop polls worker pipes, the self-pipe (SIGCHLD, stop signals) and, with
// several nodes, a PeerWatch that talks to the store on a thread of its own.
Agent::Outcome Agent::run_workers(int k) {
  WorkerGroup group(group_spec(k));
  if (!opt_.log_dir.empty())
    say("attempt " + std::to_string(k) + ": worker logs in " + opt_.log_dir + "/attempt_" + std::to_string(k) +
        "/rank_N/{stdout,stderr}.log");
  Outcome outcome = Outcome::Succeeded;
  try {
    if (!group.start([this] { return !stop_requested(); })) outcome = stop_while_starting(group, k);
  } catch (const SpawnError& e) {
    fatal_reason_ = "the fsdprun of node " + std::to_string(opt_.node_rank) + " could not start workers: " + e.what();
    say(std::string("error: ") + e.what());
    return Outcome::Fatal;
  }
  std::optional<PeerWatch> peers;
  if (several_nodes()) peers.emplace(*store_, k, opt_.monitor_interval_s);
  while (group.running()) {
    if (auto decided = supervise(group, peers ? &*peers : nullptr, k)) outcome = *decided;
  }
  group.finish_output();
  if (outcome == Outcome::Failed || outcome == Outcome::Fatal) report_flight_recorder(group, k);
  return outcome;
}

std::optional<Agent::Outcome> Agent::supervise(WorkerGroup& group, PeerWatch* peers, int k) {
  int timeout_ms = kSupervisionWakeMs;
  const int kill_in_ms = group.enforce_deadline();
  if (kill_in_ms >= 0) timeout_ms = std::min(timeout_ms, kill_in_ms);
  group.pump(timeout_ms, {SignalPipe::fd(), peers != nullptr ? peers->fd() : -1});
  std::optional<Outcome> decided;
  if (handle_signals(group)) decided = Outcome::Interrupted;
  if (dump_requested_) serve_dump_request(group, k);
  const auto failures = group.reap();
  if (!failures.empty()) {
    decided = Outcome::Failed;
    report_failures(failures, k);
    note_stopped_workers(group);
    group.stop(SIGTERM, opt_.stop_grace_s);
    continue_stopped_workers(group);
    if (peers != nullptr)
      peers->report_failure("node " + std::to_string(opt_.node_rank) + ": " + failures.front().describe());
  }
  if (peers != nullptr) {
    if (auto heard = hear_peers(group, *peers)) decided = *heard;
  }
  return decided;
}

// A failure on another node stops the local workers (unless they are stopping anyway);
// a lost store ends the run at once, as the other agents cannot be reached any more.
std::optional<Agent::Outcome> Agent::hear_peers(WorkerGroup& group, PeerWatch& peers) {
  const auto news = peers.take_news();
  if (!news) return std::nullopt;
  if (news->store_lost) throw std::runtime_error(news->why);
  if (group.stopping()) return std::nullopt;
  say("stopping the workers: the worker group failed on another node (" + news->why + ")");
  note_stopped_workers(group);
  group.stop(SIGTERM, opt_.stop_grace_s);
  continue_stopped_workers(group);
  return Outcome::Failed;
}

// A stop signal while the workers are being started: those started so far are stopped
// like a running group (SIGKILL after the grace period), and no more are started.
Agent::Outcome Agent::stop_while_starting(WorkerGroup& group, int k) {
  forward_stop_signal(group, " while starting the workers of attempt " + std::to_string(k) + " (" +
                                 std::to_string(group.started()) + " of " + std::to_string(opt_.nproc_per_node) +
                                 " started): stopping them");
  return Outcome::Interrupted;
}

// After the local workers succeeded: the run succeeded once every node is done, or
// failed (for a restart of all nodes) if another node's group failed meanwhile.
Agent::Outcome Agent::wait_for_peers(int k) {
  while (!store_->all_done(k)) {
    if (auto why = store_->failure(k)) {
      say("the worker group failed on another node (" + *why + ")");
      return Outcome::Failed;
    }
    nap(kBarrierPollMs);
    if (stop_requested()) return Outcome::Interrupted;
  }
  return Outcome::Succeeded;
}

GroupSpec Agent::group_spec(int k) const {
  GroupSpec spec;
  spec.command = opt_.command;
  spec.attempt = k;
  spec.log_dir = opt_.log_dir;
  spec.console = opt_.log_dir.empty() || opt_.tee;
  spec.prefix = !opt_.no_prefix;
  for (int local = 0; local < opt_.nproc_per_node; ++local) {
    std::vector<std::string> env = worker_environment(opt_, local, k, store_->port());
    env.erase(std::remove_if(env.begin(), env.end(),
                             [](const std::string& e) { return e.rfind("FSDP_FLIGHT_RECORDER_DIR=", 0) == 0; }),
              env.end());
    env.push_back("FSDP_FLIGHT_RECORDER_DIR=" + flight_recorder_attempt_dir(flight_dir_, k));
    spec.workers.push_back({opt_.node_rank * opt_.nproc_per_node + local, local, std::move(env)});
  }
  return spec;
}

// The first stop signal is forwarded to the workers (SIGKILL follows after the grace
// period); another one while they are stopping kills them at once.
bool Agent::handle_signals(WorkerGroup& group) {
  stop_requested();
  if (stop_signals_ == handled_signals_) return false;
  if (!group.stopping()) {
    forward_stop_signal(group, ": stopping the workers");
  } else {
    acknowledge_stop_signals();
    say("received another stop signal: killing the workers now");
    group.kill_now();
  }
  return true;
}

// Shared by a running group and one being started, so that both say the same
// "received SIGxxx<what> (SIGKILL after <grace>)" and stop the same way.
void Agent::forward_stop_signal(WorkerGroup& group, const std::string& what) {
  acknowledge_stop_signals();
  say("received " + signal_name(stop_signal_) + what + " (SIGKILL after " + format_seconds(opt_.stop_grace_s) + ")");
  group.stop(stop_signal_, opt_.stop_grace_s);
}

void Agent::acknowledge_stop_signals() {
  handled_signals_ = stop_signals_;
  if (fatal_reason_.empty())
    fatal_reason_ = "the fsdprun of node " + std::to_string(opt_.node_rank) + " received " + signal_name(stop_signal_);
}

void Agent::report_failures(const std::vector<WorkerFailure>& failures, int k) const {
  for (const auto& f : failures) {
    say("worker failed: " + f.describe());
    if (!opt_.log_dir.empty())
      say("  logs: " + log_file_path(opt_.log_dir, k, f.rank, "stdout") + " " +
          log_file_path(opt_.log_dir, k, f.rank, "stderr"));
  }
  say("stopping the other workers of attempt " + std::to_string(k) + " (SIGTERM, SIGKILL after " +
      format_seconds(opt_.stop_grace_s) + ")");
}

// Tells the other agents to stop and not to restart. Best effort: fsdprun is leaving.
void Agent::announce_stop(int k, const std::string& why) {
  if (!store_ || !several_nodes()) return;
  try {
    store_->mark_shutdown(why);
    store_->mark_failed(k, why);
  } catch (const std::exception&) {
  }
}

// Node 0 hosts the store: before leaving it waits (bounded) until every agent has
// seen the final result, so that none of them loses the store in the middle of a poll. An
// agent whose heartbeat stopped (its node gone or cut off) is not waited for.
void Agent::leave_store(bool wait_for_others) {
  if (!several_nodes()) return;
  try {
    store_->mark_exited(opt_.node_rank);
    if (!store_->is_host() || !wait_for_others) return;
    const auto deadline = Clock::now() + seconds(kExitBarrierS);
    HeartbeatsSeen seen;
    while (Clock::now() < deadline && live_agents_remain(seen)) {
      nap(kBarrierPollMs);
      if (stop_requested()) return;
    }
  } catch (const std::exception&) {
  }
}

bool Agent::live_agents_remain(HeartbeatsSeen& seen) {
  bool live = false;
  for (int node : store_->not_exited()) {
    const int64_t beat = store_->heartbeat(node);
    auto it = seen.find(node);
    if (it == seen.end() || it->second.first != beat) seen[node] = {beat, Clock::now()};
    live |= Clock::now() - seen[node].second < seconds(kSilentAgentS);
  }
  return live;
}

bool Agent::stop_requested() {
  for (int signo : SignalPipe::take()) {
    if (signo == SIGUSR1) dump_requested_ = true;
    if (!is_stop_signal(signo)) continue;  // SIGCHLD: reaping is done by the loops
    if (stop_signal_ == 0) stop_signal_ = signo;
    ++stop_signals_;
  }
  return stop_signal_ != 0;
}

void Agent::nap(int ms) const {
  pollfd p{SignalPipe::fd(), POLLIN, 0};
  poll(&p, 1, ms);
}

// ------------------------------------------------------------------ flight recorder

void Agent::note_stopped_workers(WorkerGroup& group) {
  for (const auto& [rank, pid] : group.unreaped()) {
    if (!process_stopped(pid)) continue;
    flight_status_[rank].stopped = true;
    say("rank " + std::to_string(rank) + " (pid " + std::to_string(pid) +
        ") is stopped (SIGSTOP or a debugger), not dead: it is continued after the stop signal so that it "
        "can write its flight-recorder dump");
  }
}

// The stop signal stays pending in a stopped process; SIGCONT lets it run its handler (the
// dump) and end. SIGKILL follows after the grace period as for any worker.
void Agent::continue_stopped_workers(WorkerGroup& group) {
  for (const auto& [rank, pid] : group.unreaped()) {
    if (flight_status_.count(rank) && flight_status_[rank].stopped) kill(-pid, SIGCONT);
  }
}

void Agent::report_flight_recorder(const WorkerGroup& group, int k) {
  for (const auto& [rank, how] : group.exits()) flight_status_[rank].exit = how;
  const std::string dir = flight_recorder_attempt_dir(flight_dir_, k);
  if (several_nodes()) gather_flight_dumps(k, dir);
  std::istringstream lines(diagnose_failure(dir, flight_status_, opt_.world_size()));
  for (std::string line; std::getline(lines, line);) say(line);
  flight_status_.clear();
}

void Agent::gather_flight_dumps(int k, const std::string& dir) {
  std::vector<int> local_ranks;
  for (int local = 0; local < opt_.nproc_per_node; ++local)
    local_ranks.push_back(opt_.node_rank * opt_.nproc_per_node + local);
  try {
    store_->share_flight_dumps(k, opt_.node_rank, pack_node_dumps(dir, local_ranks, flight_status_));
  } catch (const std::exception& e) {
    say(std::string("flight recorder: cannot share this node's dumps with the other nodes: ") + e.what());
    return;
  }
  // The other nodes hear of the failure within a monitor interval and give their workers the
  // grace period to dump and end before they share.
  const double wait_s = opt_.monitor_interval_s + opt_.stop_grace_s + kFlightGatherMarginS;
  const auto deadline = Clock::now() + seconds(wait_s);
  std::vector<int> missing;
  for (int node = 0; node < opt_.nnodes; ++node) {
    if (node != opt_.node_rank) missing.push_back(node);
  }
  while (!missing.empty()) {
    try {
      std::vector<int> still_missing;
      for (int node : missing) {
        auto document = store_->flight_dumps(k, node);
        if (document) unpack_node_dumps(*document, dir, &flight_status_);
        else still_missing.push_back(node);
      }
      missing = std::move(still_missing);
    } catch (const std::exception& e) {
      say(std::string("flight recorder: cannot fetch the other nodes' dumps: ") + e.what());
      return;
    }
    if (missing.empty() || Clock::now() >= deadline) break;
    nap(kBarrierPollMs);
    if (stop_requested()) break;  // asked to leave: diagnose with what is here
  }
  for (int node : missing) {
    const int first = node * opt_.nproc_per_node, last = first + opt_.nproc_per_node - 1;
    say("flight recorder: node " + std::to_string(node) + " shared no dumps within " + format_seconds(wait_s) +
        " (its fsdprun is gone or still stopping its workers): " +
        (first == last ? "rank " + std::to_string(first) + " is"
                       : "ranks " + std::to_string(first) + "-" + std::to_string(last) + " are") +
        " diagnosed without them");
  }
}

// SIGUSR1: every worker dumps and goes on; the diagnosis is a snapshot of a running job.
void Agent::serve_dump_request(WorkerGroup& group, int k) {
  dump_requested_ = false;
  const int64_t asked = wall_us();
  // Only to workers that handle it: SIGUSR1's default action would end a program that does
  // not use fsdp's flight recorder (or has not initialised it yet).
  int asked_ranks = 0;
  for (const auto& [rank, pid] : group.unreaped()) {
    if (!catches_signal(pid, SIGUSR1)) {
      say("SIGUSR1: rank " + std::to_string(rank) + " does not handle SIGUSR1 (no flight recorder yet): not asked");
      continue;
    }
    kill(pid, SIGUSR1);
    ++asked_ranks;
  }
  const std::string dir = flight_recorder_attempt_dir(flight_dir_, k);
  const bool all = wait_for_dumps(dir, asked_ranks, asked, 3000);
  say("SIGUSR1: flight-recorder snapshot of the running job (it goes on):");
  std::istringstream lines(diagnose_dir(dir, {}, opt_.world_size()));
  for (std::string line; std::getline(lines, line);) say(line);
  if (!all) say("flight recorder: not every worker wrote a dump within 3 s");
}

}  // namespace fsdprun
