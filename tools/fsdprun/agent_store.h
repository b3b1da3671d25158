// The rendezvous store of the run, and the small protocol the agents (the fsdprun of
// each node) follow through it. Like torchrun's agent, the fsdprun of node 0 hosts a
// c10d::TCPStore server on MASTER_PORT for the whole run (all restarts); workers
// connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True) under /worker/...,
// fsdprun's own keys live under /fsdprun/.
#pragma once

#include "options.h"

#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <memory>
#include <cstdint>
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
  ~AgentStore();

  int port() const { return port_; }
  bool is_host() const { return host_; }

  // Every agent registers once, when it starts; node 0 waits for those at the end.
  void register_agent();
  // Before attempt K, every agent joins; workers start once all nnodes agents joined.
  void join(int attempt, int node);
  int64_t joined(int attempt);  // how many agents joined attempt K so far
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
  void mark_exited();
  bool all_exited();

 private:
  void host(const Options& opt);
  void connect(const Options& opt, const std::function<bool()>& keep_waiting);
  std::optional<std::string> get_if_set(const std::string& key);
  int64_t counter(const std::string& key, int64_t delta);

  c10::intrusive_ptr<c10d::TCPStore> store_;
  int nnodes_ = 1;
  int port_ = 0;
  bool host_ = false;
};

}  // namespace fsdprun
