// The agent: runs the local worker group, watches it, restarts it, and agrees with the
// agents of the other nodes (through the store) on when to start, stop and give up.
#pragma once

#include "agent_store.h"
#include "flight_diagnosis.h"
#include "options.h"
#include "peer_watch.h"
#include "worker_group.h"

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdprun {

class Agent {
 public:
  explicit Agent(Options opt) : opt_(std::move(opt)) {}
  // Runs to the end; returns fsdprun's exit status (0, 1, or 128+signal).
  int run();

 private:
  enum class Outcome {
    Succeeded,    // every worker of every node exited 0
    Failed,       // a worker failed here or on another node: restart if allowed
    Fatal,        // failed, and restarting cannot help (or another node gave up)
    Interrupted,  // fsdprun got a stop signal
  };

  // With one node there is nobody to agree with: the agent then never talks to the
  // store, which it hosts for the workers only.
  bool several_nodes() const { return opt_.nnodes > 1; }
  // The attempt this agent starts with: 0, or the job's current one for an agent started late.
  int first_attempt();
  // A returning node's agent, whose node joined attempt k already: the attempt to join instead.
  int wait_for_next_attempt(int k);
  Outcome attempt(int k);
  std::optional<int> conclude(int k, Outcome o);
  std::optional<Outcome> wait_for_agents(int k);  // nullopt: all agents joined
  Outcome run_workers(int k);
  // One round of the supervision loop; returns the attempt's outcome once known.
  std::optional<Outcome> supervise(WorkerGroup& group, PeerWatch* peers, int k);
  std::optional<Outcome> hear_peers(WorkerGroup& group, PeerWatch& peers);
  Outcome stop_while_starting(WorkerGroup& group, int k);
  Outcome wait_for_peers(int k);
  GroupSpec group_spec(int k) const;
  bool handle_signals(WorkerGroup& group);
  // Says so and sends the first stop signal to the workers (SIGKILL after the grace period).
  void forward_stop_signal(WorkerGroup& group, const std::string& what);
  // The worker group has been told of every stop signal so far; the first one becomes
  // the reason given to the other agents, unless there is one already.
  void acknowledge_stop_signals();
  void report_failures(const std::vector<WorkerFailure>& failures, int k) const;
  void announce_stop(int k, const std::string& why);
  void leave_store(bool wait_for_others);
  // Node N -> its heartbeat count, and when that count last moved.
  using HeartbeatsSeen = std::map<int, std::pair<int64_t, std::chrono::steady_clock::time_point>>;
  // True while some agent that has not exited has beaten recently (updates `seen`).
  bool live_agents_remain(HeartbeatsSeen& seen);
  // Reads the self-pipe; returns true when a stop signal (SIGINT/TERM/HUP) is pending.
  bool stop_requested();
  // Sleeps up to ms, waking early on a signal.
  void nap(int ms) const;
  // The flight recorder: before the workers are stopped after a failure, notes which are
  // stopped (SIGSTOP) and continues them after the stop signal so that they can dump; once the
  // group is gone, prints the diagnosis of the dumps. SIGUSR1 asks the workers for dumps.
  void note_stopped_workers(WorkerGroup& group);
  void continue_stopped_workers(WorkerGroup& group);
  void report_flight_recorder(const WorkerGroup& group, int k);
  // Several nodes: shares this node's dumps through the store and fetches the other nodes'
  // into `dir` (waiting, bounded, for nodes still stopping their workers).
  void gather_flight_dumps(int k, const std::string& dir);
  void serve_dump_request(WorkerGroup& group, int k);

  std::string flight_dir_;  // base folder of the dumps (flight_recorder_base_dir)
  std::map<int, RankStatus> flight_status_;
  bool dump_requested_ = false;  // SIGUSR1 arrived

  Options opt_;
  std::unique_ptr<AgentStore> store_;
  int stop_signal_ = 0;       // the first stop signal received, 0 if none
  int stop_signals_ = 0;      // how many stop signals were received
  int handled_signals_ = 0;   // how many of them the worker group has been told of
  std::string fatal_reason_;  // told to the other agents when this one stops for good
};

}  // namespace fsdprun
