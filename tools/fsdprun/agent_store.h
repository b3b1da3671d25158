// The rendezvous store of the run, and the small protocol the agents (the fsdprun of
// each node) follow through it. Like torchrun's agent, the fsdprun of node 0 hosts a
// c10d::TCPStore server on MASTER_PORT for the whole run (all restarts); workers
// connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True) under /worker/...,
// fsdprun's own keys live under /fsdprun/.
//
// Every request is bounded (src/comm/bounded_store.h): an agent cut off from node 0 (its link
// or node 0 down) gets "lost the agent store ... did not answer within 15000 ms" instead of
// hanging in a request, and stops its workers.
#pragma once

#include "options.h"
#include "src/comm/bounded_store.h"

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace c10d {
class TCPStore;
}

namespace fsdprun {

// A stop signal arrived while waiting for the store.
struct Interrupted : std::runtime_error {
  Interrupted() : std::runtime_error("interrupted") {}
};

class AgentStore {
 public:
  // Node 0 hosts the store (with --standalone: on a free port, listening on loopback
  // only), on c10d's server that no stalled or lying client holds up (store_server.h);
  // other nodes connect to it, retrying until --join-timeout. keep_waiting is asked
  // between retries; when it says false, Interrupted is thrown. Store errors are thrown
  // as std::runtime_error with a one-line message (a port in use says so).
  AgentStore(const Options& opt, const std::function<bool()>& keep_waiting);
  // Stops the heartbeat (at most the end of one bounded request).
  ~AgentStore();

  // How long any one request may take before the store counts as lost.
  static constexpr std::chrono::milliseconds kRequestDeadline{15000};
  // How often a registered agent of another node says it is alive.
  static constexpr std::chrono::milliseconds kHeartbeatPeriod{1000};

  int port() const { return port_; }
  bool is_host() const { return host_; }

  // Every agent registers once, when it starts; node 0 waits for those at the end. An agent of
  // another node then bumps its heartbeat every kHeartbeatPeriod on a thread of its own, until
  // it is destroyed or the store is lost.
  void register_agent(int node);
  // Node 0 says which attempt the job is in, so that an agent started later (its host back)
  // joins that one; current_attempt() is 0 until node 0 says otherwise.
  void begin_attempt(int attempt);
  int current_attempt();
  // Before attempt K, every agent joins; workers start once all nnodes agents joined.
  void join(int attempt, int node);
  int64_t joined(int attempt);  // how many agents joined attempt K so far
  // Whether node N's agent joined attempt K (a node's agent started again sees its earlier self).
  bool has_joined(int attempt, int node);
  // The nodes whose agent has not joined attempt K, ascending (for the join timeout's message).
  std::vector<int> not_joined(int attempt);
  // An agent whose group failed (or who was interrupted) marks the attempt failed;
  // every agent polls this while its workers run, and stops them when it appears.
  void mark_failed(int attempt, const std::string& why);
  std::optional<std::string> failure(int attempt);
  // An agent whose workers all succeeded; the run succeeded once every node is done.
  void mark_done(int attempt);
  bool all_done(int attempt);
  // No more restarts anywhere (an agent was interrupted or cannot start its workers).
  void mark_shutdown(const std::string& why);
  std::optional<std::string> shutdown();
  // The flight-recorder dumps of node N's ranks for attempt K (flight_dumps.h's document),
  // shared once that node's workers are gone after a failure.
  void share_flight_dumps(int attempt, int node, const std::string& document);
  std::optional<std::string> flight_dumps(int attempt, int node);
  // Lets node 0 keep the store up until every registered agent has read its final
  // answer (an agent that never came does not keep it waiting).
  void mark_exited(int node);
  // The registered nodes (other than node 0) that have not exited, ascending.
  std::vector<int> not_exited();
  // Node N's heartbeat count: it stops moving when that agent is gone or cut off.
  int64_t heartbeat(int node);

 private:
  void host(const Options& opt);
  void connect(const Options& opt, const std::function<bool()>& keep_waiting);
  std::optional<std::string> get_if_set(const std::string& key);
  int64_t counter(const std::string& key, int64_t delta);
  void beat_until_stopped(int node);

  c10::intrusive_ptr<c10d::TCPStore> store_;
  std::unique_ptr<fsdp::comm::BoundedStore> requests_;  // every request goes through it
  int nnodes_ = 1;
  int port_ = 0;
  bool host_ = false;
  std::mutex beat_mu_;
  std::condition_variable beat_wake_;
  bool beat_stop_ = false;
  std::thread beat_thread_;
};

}  // namespace fsdprun
