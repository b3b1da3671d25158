#include "agent.h"

#include "output.h"
#include "signals.h"
#include "worker_env.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <optional>
#include <poll.h>
#include <sstream>

namespace fsdprun {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kBarrierPollMs = 50;       // store polling while waiting for other agents
constexpr double kExitBarrierS = 30.0;   // node 0 keeps the store up this long at most

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

int ms_until(Clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, ms));
}

std::string format_seconds(double s) {
  std::ostringstream out;
  out << s << "s";
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
    store_ = std::make_unique<AgentStore>(opt_, [this] { return !stop_requested(); });
    for (int k = 0;; ++k) {
      if (auto exit_code = conclude(k, attempt(k))) return *exit_code;
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
  if (o == Outcome::Failed) {
    if (auto why = store_->shutdown()) {
      say("not restarting: " + *why);
      o = Outcome::Fatal;
    }
  }
  if (o == Outcome::Failed && k < opt_.max_restarts) {
    say("restarting the worker group: restart " + std::to_string(k + 1) + " of " +
        std::to_string(opt_.max_restarts) + " (TORCHELASTIC_RESTART_COUNT=" + std::to_string(k + 1) + ")");
    return std::nullopt;
  }
  if (o == Outcome::Failed && opt_.max_restarts == 0) say("the worker group failed; exiting with code 1");
  if (o == Outcome::Failed && opt_.max_restarts > 0)
    say("giving up after " + std::to_string(opt_.max_restarts) + " restart(s); exiting with code 1");
  leave_store(/*wait_for_others=*/true);
  return o == Outcome::Succeeded ? 0 : 1;
}

Agent::Outcome Agent::attempt(int k) {
  if (auto o = wait_for_agents(k)) return *o;
  const Outcome o = run_workers(k);
  if (o != Outcome::Succeeded) return o;
  store_->mark_done(k);
  return wait_for_peers(k);
}

// All agents join attempt k before any starts workers, so that the ranks of every
// node rendezvous within the same attempt (same TORCHELASTIC_RESTART_COUNT).
std::optional<Agent::Outcome> Agent::wait_for_agents(int k) {
  store_->join(k);
  const auto deadline = Clock::now() + seconds(opt_.join_timeout_s);
  while (!store_->all_joined(k)) {
    if (auto why = store_->shutdown()) {
      say("stopping: " + *why);
      return Outcome::Fatal;
    }
    if (Clock::now() >= deadline) {
      fatal_reason_ = "the fsdprun of node " + std::to_string(opt_.node_rank) +
                      " timed out waiting for the other nodes";
      say("error: timed out after " + format_seconds(opt_.join_timeout_s) + " waiting for the fsdprun of all " +
          std::to_string(opt_.nnodes) + " nodes to join attempt " + std::to_string(k));
      return Outcome::Fatal;
    }
    nap(kBarrierPollMs);
    if (stop_requested()) return Outcome::Interrupted;
  }
  return std::nullopt;
}

Agent::Outcome Agent::run_workers(int k) {
  WorkerGroup group(group_spec(k));
  if (!opt_.log_dir.empty())
    say("attempt " + std::to_string(k) + ": worker logs in " + opt_.log_dir + "/attempt_" + std::to_string(k) +
        "/rank_N/{stdout,stderr}.log");
  try {
    group.start();
  } catch (const SpawnError& e) {
    fatal_reason_ = "the fsdprun of node " + std::to_string(opt_.node_rank) + " could not start workers: " + e.what();
    say(std::string("error: ") + e.what());
    return Outcome::Fatal;
  }
  Outcome outcome = Outcome::Succeeded;
  auto next_poll = Clock::now() + seconds(opt_.monitor_interval_s);
  while (group.running()) {
    int timeout_ms = ms_until(next_poll);
    const int kill_in_ms = group.enforce_deadline();
    if (kill_in_ms >= 0) timeout_ms = std::min(timeout_ms, kill_in_ms);
    group.pump(timeout_ms, SignalPipe::fd());
    if (handle_signals(group)) outcome = Outcome::Interrupted;
    const auto failures = group.reap();
    if (!failures.empty()) {
      outcome = Outcome::Failed;
      report_failures(failures, k);
      store_->mark_failed(k, "node " + std::to_string(opt_.node_rank) + ": " + failures.front().describe());
      group.stop(SIGTERM, opt_.stop_grace_s);
    }
    if (Clock::now() >= next_poll) {
      auto why = group.stopping() ? std::nullopt : store_->failure(k);
      if (why) {
        outcome = Outcome::Failed;
        say("stopping the workers: the worker group failed on another node (" + *why + ")");
        group.stop(SIGTERM, opt_.stop_grace_s);
      }
      next_poll = Clock::now() + seconds(opt_.monitor_interval_s);
    }
  }
  group.finish_output();
  return outcome;
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
    spec.workers.push_back({opt_.node_rank * opt_.nproc_per_node + local, local,
                            worker_environment(opt_, local, k, store_->port())});
  }
  return spec;
}

// The first stop signal is forwarded to the workers (SIGKILL follows after the grace
// period); another one while they are stopping kills them at once.
bool Agent::handle_signals(WorkerGroup& group) {
  const int before = stop_signals_;
  stop_requested();
  if (stop_signals_ == before) return false;
  if (fatal_reason_.empty())
    fatal_reason_ = "the fsdprun of node " + std::to_string(opt_.node_rank) + " received " + signal_name(stop_signal_);
  if (!group.stopping()) {
    say("received " + signal_name(stop_signal_) + ": stopping the workers (SIGKILL after " +
        format_seconds(opt_.stop_grace_s) + ")");
    group.stop(stop_signal_, opt_.stop_grace_s);
  } else {
    say("received another stop signal: killing the workers now");
    group.kill_now();
  }
  return true;
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
  if (!store_ || opt_.nnodes == 1) return;
  try {
    store_->mark_shutdown(why);
    store_->mark_failed(k, why);
  } catch (const std::exception&) {
  }
}

// Node 0 hosts the store: before leaving it waits (bounded) until every agent has
// seen the final result, so that none of them loses the store in the middle of a poll.
void Agent::leave_store(bool wait_for_others) {
  try {
    store_->mark_exited();
    if (!store_->is_host() || !wait_for_others) return;
    const auto deadline = Clock::now() + seconds(kExitBarrierS);
    while (!store_->all_exited() && Clock::now() < deadline) {
      nap(kBarrierPollMs);
      if (stop_requested()) return;
    }
  } catch (const std::exception&) {
  }
}

bool Agent::stop_requested() {
  for (int signo : SignalPipe::take()) {
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

}  // namespace fsdprun
