// Keeping an eye on the other nodes while the local workers run, without the agent's
// supervision loop ever waiting for the store: a store request can take long (node 0
// far away, or its server busy with a slow client), and noticing and stopping local
// workers must not wait for it. Used only with several nodes; a single node has nobody
// to hear from, and its agent does not talk to the store at all.
#pragma once

#include "agent_store.h"

#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace fsdprun {

// Why the local group must stop, as learnt from the store.
struct PeerNews {
  std::string why;
  bool store_lost = false;  // the store itself failed (why is the error): stop at once
};

// Watches attempt K on a thread of its own: polls /fsdprun/attempt_K/failed every
// interval_s, and publishes this node's failure when told to. The caller polls fd() with
// its other descriptors and then calls take_news(). While a PeerWatch lives, the agent's own
// thread leaves the store to it: the store serves one request at a time, and the agent's
// thread must not wait behind one.
class PeerWatch {
 public:
  PeerWatch(AgentStore& store, int attempt, double interval_s);
  // Stops the thread and waits for it: at most the end of one store request.
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // Readable while take_news() has something to return; never read by the caller.
  int fd() const { return pipe_[0]; }
  // The news, once: later calls return nothing (and fd() is no longer readable).
  std::optional<PeerNews> take_news();
  // Tells the other agents that this node's group failed (the first report in the store
  // wins) and stops polling: this node is stopping its workers anyway. Returns at once;
  // the destructor waits until the report is in the store.
  void report_failure(const std::string& why);

 private:
  void loop();
  std::optional<PeerNews> ask_store(const std::string& report);
  void publish(PeerNews news);  // under mu_

  AgentStore& store_;
  const int attempt_;
  const double interval_s_;
  int pipe_[2] = {-1, -1};
  std::mutex mu_;
  std::condition_variable wake_;
  bool quit_ = false;
  std::string report_;            // a failure to publish, empty if none
  bool done_ = false;             // this node reported, or news arrived: no more polling
  std::optional<PeerNews> news_;  // not taken yet
  std::thread thread_;
};

}  // namespace fsdprun
