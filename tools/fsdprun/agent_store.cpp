#include "agent_store.h"

#include "src/comm/store_server.h"

#include <c10/util/Flags.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <thread>
#include <unistd.h>

namespace fsdprun {
namespace {

using Ms = std::chrono::milliseconds;

const char* const kLostStore = "lost the agent store (hosted by the fsdprun of node 0)";
constexpr Ms kProbeTimeout{1000};  // one connection probe; signals are checked in between

std::string key(int attempt, const char* name) { return "/fsdprun/attempt_" + std::to_string(attempt) + "/" + name; }

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

// LibTorch's c10::Error carries a C++ backtrace in what(); keep the message only.
// (c10d's socket errors, e.g. timeouts, are plain std::runtime_error subclasses.)
std::string message_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

template <typename F>
auto guarded(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    throw std::runtime_error(what + ": " + message_of(e));
  }
}

Ms seconds(double s) { return Ms(static_cast<int64_t>(s * 1000)); }

// True when a TCP connection to host:port succeeds within kProbeTimeout.
bool accepts_connections(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return false;
  bool ok = false;
  for (const addrinfo* a = found; a != nullptr && !ok; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      ok = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof err;
      ok = poll(&p, 1, static_cast<int>(kProbeTimeout.count())) == 1 &&
           getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    close(fd);
  }
  freeaddrinfo(found);
  return ok;
}

// fsdprun reports every store error itself, in one line that names the option to change;
// c10d's own log lines (e.g. one per address it failed to bind) would only come first
// and repeat it. They stay on when the user asks for them with TORCH_CPP_LOG_LEVEL.
// c10::ParseCommandLineFlags sets c10's threshold whether or not LibTorch uses gflags.
void silence_c10d_logging() {
  if (std::getenv("TORCH_CPP_LOG_LEVEL") != nullptr) return;
  char name[] = "fsdprun";
  char level[] = "--caffe2_log_level=3";  // FATAL only: c10d logs nothing
  char* args[] = {name, level, nullptr};
  int argc = 2;
  char** argv = args;
  c10::ParseCommandLineFlags(&argc, &argv);
}

c10d::TCPStoreOptions client_options(int port, Ms timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(port);
  o.isServer = false;
  o.numWorkers = c10::nullopt;
  o.waitWorkers = false;
  o.timeout = timeout;
  return o;
}

}  // namespace

AgentStore::AgentStore(const Options& opt, const std::function<bool()>& keep_waiting)
    : nnodes_(opt.nnodes), host_(opt.node_rank == 0) {
  silence_c10d_logging();
  if (host_) {
    host(opt);
  } else {
    connect(opt, keep_waiting);
  }
  const std::string where = host_ ? std::string("the agent store (hosted here)")
                                  : "the agent store of node 0 at " + opt.master_addr + ":" + std::to_string(port_);
  requests_ = std::make_unique<fsdp::comm::BoundedStore>(store_, kRequestDeadline, where);
}

AgentStore::~AgentStore() {
  {
    std::lock_guard<std::mutex> lock(beat_mu_);
    beat_stop_ = true;
  }
  beat_wake_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();
}

// --standalone: loopback only, on any free port. Otherwise --master-addr's address on
// MASTER_PORT, where the other nodes look for it, and nowhere else; every address of the port
// (as torchrun's) when --master-addr is not an address of this host (a name that resolves
// elsewhere here, say behind a NAT), or is a loopback one while other nodes must reach it (a
// host name that /etc/hosts maps to 127.0.1.1, as Debian's does). Either way c10d's
// non-blocking server, which a stalled or lying client cannot hold up (src/comm/store_server.h).
void AgentStore::host(const Options& opt) {
  fsdp::comm::StoreServerOptions o;
  const bool loopback_for_others = opt.nnodes > 1 && fsdp::comm::is_loopback_address(opt.master_addr);
  o.bind_address = opt.standalone ? "127.0.0.1" : loopback_for_others ? "" : opt.master_addr;
  o.port = opt.standalone ? 0 : opt.master_port;
  o.timeout = seconds(opt.join_timeout_s);
  const std::string what = opt.standalone ? std::string("cannot host the agent store on loopback")
                                          : "cannot host the agent store on port " + std::to_string(opt.master_port);
  try {
    try {
      store_ = fsdp::comm::host_store(o);
    } catch (const fsdp::comm::StoreBindError& e) {
      if (opt.standalone || e.address_in_use()) throw;
      o.bind_address = "";  // --master-addr is not this host's: every address of the port
      store_ = fsdp::comm::host_store(o);
    }
  } catch (const fsdp::comm::StoreBindError& e) {
    if (!e.address_in_use() || opt.standalone) throw std::runtime_error(what + ": " + e.what());
    throw std::runtime_error(what +
                             ": the port is already in use (by another fsdprun or another program); "
                             "choose a free --master-port, or use --standalone on a single node");
  } catch (const std::exception& e) {
    throw std::runtime_error(what + ": " + message_of(e));
  }
  port_ = store_->getPort();
}

// Waits for node 0's store with plain connection probes (which can be interrupted by
// signals, and do not make LibTorch log a timeout error per try), then connects.
void AgentStore::connect(const Options& opt, const std::function<bool()>& keep_waiting) {
  port_ = opt.master_port;
  const std::string where = opt.master_addr + ":" + std::to_string(port_);
  const auto deadline = std::chrono::steady_clock::now() + seconds(opt.join_timeout_s);
  std::string last_error;
  for (;;) {
    if (accepts_connections(opt.master_addr, port_)) {
      try {
        store_ =
            c10::make_intrusive<c10d::TCPStore>(opt.master_addr, client_options(port_, seconds(opt.join_timeout_s)));
        return;
      } catch (const std::exception& e) {
        last_error = ": " + message_of(e);
      }
    }
    if (std::chrono::steady_clock::now() >= deadline)
      throw std::runtime_error("cannot reach the agent store of node 0 at " + where + " within --join-timeout" +
                               last_error);
    if (!keep_waiting()) throw Interrupted();
    std::this_thread::sleep_for(Ms(100));
  }
}

int64_t AgentStore::counter(const std::string& k, int64_t delta) {
  return guarded(kLostStore, [&] { return requests_->add(k, delta); });
}

std::optional<std::string> AgentStore::get_if_set(const std::string& k) {
  return guarded(kLostStore, [&]() -> std::optional<std::string> {
    if (!requests_->check({k})) return std::nullopt;
    const auto value = requests_->get(k);
    return std::string(value.begin(), value.end());
  });
}

void AgentStore::begin_attempt(int attempt) {
  guarded(kLostStore, [&] { requests_->set("/fsdprun/current_attempt", bytes(std::to_string(attempt))); });
}

int AgentStore::current_attempt() {
  const auto value = get_if_set("/fsdprun/current_attempt");
  if (!value) return 0;
  try {
    return std::stoi(*value);
  } catch (const std::exception&) {
    throw std::runtime_error("the agent store's /fsdprun/current_attempt holds '" + *value +
                             "', not an attempt number: is another program using --master-port?");
  }
}

void AgentStore::join(int attempt, int node) {
  guarded(kLostStore, [&] { requests_->set(key(attempt, "joined_node_") + std::to_string(node), bytes("1")); });
  counter(key(attempt, "joined"), 1);
}
int64_t AgentStore::joined(int attempt) { return counter(key(attempt, "joined"), 0); }

bool AgentStore::has_joined(int attempt, int node) {
  const std::string k = key(attempt, "joined_node_") + std::to_string(node);
  return guarded(kLostStore, [&] { return requests_->check({k}); });
}

std::vector<int> AgentStore::not_joined(int attempt) {
  std::vector<int> missing;
  for (int node = 0; node < nnodes_; ++node) {
    if (!has_joined(attempt, node)) missing.push_back(node);
  }
  return missing;
}

void AgentStore::mark_failed(int attempt, const std::string& why) {
  // The first failure is the interesting one: later ones are usually its consequences.
  guarded(kLostStore, [&] { requests_->compare_set(key(attempt, "failed"), {}, bytes(why)); });
}
std::optional<std::string> AgentStore::failure(int attempt) { return get_if_set(key(attempt, "failed")); }

void AgentStore::mark_done(int attempt) { counter(key(attempt, "done"), 1); }
bool AgentStore::all_done(int attempt) { return counter(key(attempt, "done"), 0) >= nnodes_; }

void AgentStore::mark_shutdown(const std::string& why) {
  guarded(kLostStore, [&] { requests_->compare_set("/fsdprun/shutdown", {}, bytes(why)); });
}
std::optional<std::string> AgentStore::shutdown() { return get_if_set("/fsdprun/shutdown"); }

namespace {
std::string flight_key(int attempt, int node) { return key(attempt, "flight_dumps/node_") + std::to_string(node); }
}  // namespace

void AgentStore::share_flight_dumps(int attempt, int node, const std::string& document) {
  guarded(kLostStore, [&] { requests_->set(flight_key(attempt, node), bytes(document)); });
}
std::optional<std::string> AgentStore::flight_dumps(int attempt, int node) {
  return get_if_set(flight_key(attempt, node));
}

namespace {
std::string node_key(const char* what, int node) {
  return std::string("/fsdprun/") + what + "/node_" + std::to_string(node);
}
}  // namespace

void AgentStore::register_agent(int node) {
  guarded(kLostStore, [&] { requests_->set(node_key("agents", node), bytes("1")); });
  if (host_) return;
  beat_thread_ = std::thread([this, node] { beat_until_stopped(node); });
}

// Stops at the first failed request: an agent whose store is lost learns it from its own
// requests, and node 0 from the heartbeat that stopped moving.
void AgentStore::beat_until_stopped(int node) {
  std::unique_lock<std::mutex> lock(beat_mu_);
  while (!beat_stop_) {
    lock.unlock();
    try {
      requests_->add(node_key("alive", node), 1);
    } catch (const std::exception&) {
      return;
    }
    lock.lock();
    beat_wake_.wait_for(lock, kHeartbeatPeriod, [this] { return beat_stop_; });
  }
}

int64_t AgentStore::heartbeat(int node) { return counter(node_key("alive", node), 0); }

void AgentStore::mark_exited(int node) {
  guarded(kLostStore, [&] { requests_->set(node_key("exited", node), bytes("1")); });
}

std::vector<int> AgentStore::not_exited() {
  std::vector<int> running;
  for (int node = 1; node < nnodes_; ++node) {
    const bool registered = guarded(kLostStore, [&] { return requests_->check({node_key("agents", node)}); });
    if (registered && !guarded(kLostStore, [&] { return requests_->check({node_key("exited", node)}); }))
      running.push_back(node);
  }
  return running;
}

}  // namespace fsdprun
