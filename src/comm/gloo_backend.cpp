// The CPU collectives. Where data moves: the algorithm functions below, each run on the
// group's communication thread (QueuedProcessGroup). Who waits: the caller, through Work::wait().
#include "src/comm/gloo_backend.h"

#include "src/comm/p2p_algorithms.h"
#include "src/comm/progress_board.h"
#include "src/util/tensor_bytes.h"

#include <c10/util/Exception.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace fsdp {
namespace comm {
namespace {

using Clock = std::chrono::steady_clock;
using detail::bytes_of;

// Large transfers move in segments so that reducing one segment overlaps receiving the next.
constexpr size_t kSegmentBytes = size_t{4} << 20;

// gloo's rendezvous talks to c10d's store through this adapter.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  explicit GlooStoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::vector<uint8_t> v = store_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

std::string ranks_str(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  s << "]";
  return s.str();
}

}  // namespace

// ------------------------------------------------------------------------------ GlooTransfers

// The point-to-point transfers of one algorithm step. Sends and receives are posted at once and
// progress on Gloo's I/O thread; the waits are bounded by the operation's deadline and count
// the bytes that actually moved.
class GlooProcessGroup::GlooTransfers final : public Transfers {
 public:
  GlooTransfers(GlooProcessGroup& group, CollectiveKind kind) : group_(group), kind_(kind) {}

  void send(const char* ptr, size_t nbytes, int peer, uint64_t slot) override {
    for (size_t off = 0, seg = 0; off < nbytes; off += kSegmentBytes, ++seg) {
      const size_t len = std::min(kSegmentBytes, nbytes - off);
      auto buf = group_.context_->createUnboundBuffer(const_cast<char*>(ptr) + off, len);
      buf->send(peer, slot + seg, 0, len);
      sends_.push_back({std::move(buf), nullptr, len});
    }
  }

  void recv(char* ptr, size_t nbytes, int peer, uint64_t slot) override {
    for (size_t off = 0, seg = 0; off < nbytes; off += kSegmentBytes, ++seg) {
      const size_t len = std::min(kSegmentBytes, nbytes - off);
      auto buf = group_.context_->createUnboundBuffer(ptr + off, len);
      buf->recv(peer, slot + seg, 0, len);
      recvs_.push_back({std::move(buf), ptr + off, len});
    }
  }

  // A transfer that does not complete by the deadline throws a plain exception: execute() turns
  // it (like any other failure of an algorithm) into the CollectiveError that names the op and
  // the absent ranks.
  void wait_recvs(const std::function<void(char*, size_t)>& on_segment) override {
    for (auto& r : recvs_) {
      if (!r.buffer->waitRecv(nullptr, remaining())) throw std::runtime_error("receive aborted");
      group_.count_bytes(kind_, 0, static_cast<int64_t>(r.nbytes));
      on_segment(r.ptr, r.nbytes);
    }
    recvs_.clear();
  }
  using Transfers::wait_recvs;

  void wait_sends() override {
    for (auto& s : sends_) {
      if (!s.buffer->waitSend(nullptr, remaining())) throw std::runtime_error("send aborted");
      group_.count_bytes(kind_, static_cast<int64_t>(s.nbytes), 0);
    }
    sends_.clear();
  }

 private:
  // Rounded up, so that a transfer Gloo gives up on has really outlived the deadline and the
  // error says "timed out" (truncating let Gloo stop up to 1 ms early).
  std::chrono::milliseconds remaining() const {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(group_.deadline_ - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }

  struct Pending {
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    char* ptr;
    size_t nbytes;
  };
  GlooProcessGroup& group_;
  const CollectiveKind kind_;
  std::vector<Pending> sends_;
  std::vector<Pending> recvs_;
};

// ------------------------------------------------------------------------------ lifecycle

// A member's connectFullMesh can return while a peer is still finishing its side of their pair's
// handshake; a member that then left at once (a group created and never used) made the peer's
// connect fail with "connection closed by peer". Returning only once every member has connected
// makes group creation a true collective.
void GlooProcessGroup::wait_until_every_member_connected() {
  const std::string prefix = "fsdp_connected/" + name() + "/";
  config_.store->set(prefix + std::to_string(rank()), std::vector<uint8_t>{1});
  std::vector<std::string> keys;
  for (int r = 0; r < size(); ++r) keys.push_back(prefix + std::to_string(r));
  config_.store->wait(keys, timeout());
}

GlooProcessGroup::GlooProcessGroup(GlooGroupConfig config)
    : QueuedProcessGroup(config.rank, config.global_ranks, config.name, config.timeout, "gloo"),
      config_(std::move(config)) {
  if (size() > 1) {
    gloo::transport::tcp::attr attr;
    if (!config_.transport_iface.empty()) {
      attr.iface = config_.transport_iface;
    } else {
      attr.hostname = config_.transport_host;
    }
    try {
      auto device = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank(), size());
      context->setTimeout(timeout());
      GlooStoreAdapter store(config_.store);
      context->connectFullMesh(store, device);
      wait_until_every_member_connected();
      context_ = std::move(context);
    } catch (const std::exception& e) {
      throw CollectiveError("fsdp: could not connect process group '" + name() + "' (global ranks " +
                            ranks_str(global_ranks()) + ") within " +
                            std::to_string(timeout().count()) + " ms: " + e.what() +
                            ". Check that every member creates this group and that the transport "
                            "address is reachable (GLOO_SOCKET_IFNAME).");
    }
  }
  start_thread();
}

GlooProcessGroup::~GlooProcessGroup() { stop_thread(); }

void GlooProcessGroup::execute(const Op& op, int64_t seq) {
  deadline_ = Clock::now() + timeout();
  if (config_.board) config_.board->entered(name(), seq);
  try {
    switch (op.kind) {
      case CollectiveKind::kAllGather: all_gather(op, seq); break;
      case CollectiveKind::kReduceScatter: reduce_scatter(op, seq); break;
      case CollectiveKind::kAllReduce: all_reduce(op, seq); break;
      case CollectiveKind::kBroadcast: broadcast(op, seq); break;
      case CollectiveKind::kBarrier: barrier(seq); break;
    }
    // The waits are bounded by the deadline only while this process runs. One that was stopped
    // (SIGSTOP, a debugger) past it can find its peers' bytes already buffered and complete,
    // while those peers have timed out and declared the group unusable: it fails as they did.
    if (Clock::now() > deadline_) {
      fail(op, seq, "completed only after the deadline; this process did not run for part of it");
    }
  } catch (const CollectiveError&) {
    throw;
  } catch (const std::exception& e) {
    fail(op, seq, e.what());
  }
}

// Builds the error for a failed operation, naming the ranks that never arrived when it can.
void GlooProcessGroup::fail(const Op& op, int64_t seq, const std::string& cause) {
  // A little slack: Gloo's own timer and this clock may disagree by a few microseconds.
  const bool timed_out = Clock::now() + std::chrono::milliseconds(2) >= deadline_;
  std::ostringstream msg;
  msg << "fsdp: " << to_string(op.kind) << " #" << seq << " on process group '" << name()
      << "' (global ranks " << ranks_str(global_ranks()) << ", this is group rank " << rank() << ") ";
  if (timed_out) {
    msg << "timed out after " << timeout().count() << " ms";
  } else {
    msg << "failed: " << cause;
  }
  if (config_.board) msg << diagnose_absent_and_stalled(seq);
  if (timed_out) msg << " [transport: " << cause << "]";
  msg << ". The group is now unusable. If a rank is only slow, raise the timeout "
         "(fsdp::InitOptions().timeout(...) or FSDP_COLLECTIVE_TIMEOUT_MS).";
  throw CollectiveError(msg.str());
}

// Which members never entered collective `seq`, and which stopped making progress.
std::string GlooProcessGroup::diagnose_absent_and_stalled(int64_t seq) {
  return describe_absent_and_stalled(*config_.board, name(), global_ranks(), seq);
}

// ------------------------------------------------------------------------------ algorithms

Transport GlooProcessGroup::transport(CollectiveKind kind, int64_t seq) {
  Transport t;
  t.rank = rank();
  t.size = size();
  t.seq = seq;
  t.transfers = [this, kind] { return std::make_unique<GlooTransfers>(*this, kind); };
  t.scratch = [this](size_t nbytes) { return scratch(nbytes); };
  return t;
}

void GlooProcessGroup::all_gather(const Op& op, int64_t seq) {
  direct_all_gather(transport(op.kind, seq), bytes_of(op.output), bytes_of(op.input), op.counts,
                    op.output.element_size());
}

void GlooProcessGroup::reduce_scatter(const Op& op, int64_t seq) {
  ring_reduce_scatter(transport(op.kind, seq), bytes_of(op.output), bytes_of(op.input), op.counts,
                      op.output.scalar_type(), op.reduce);
}

void GlooProcessGroup::all_reduce(const Op& op, int64_t seq) {
  comm::all_reduce(transport(op.kind, seq), bytes_of(op.input), op.input.numel(), op.input.scalar_type(), op.reduce);
}

void GlooProcessGroup::broadcast(const Op& op, int64_t seq) {
  const int W = size(), r = rank();
  const size_t nbytes = op.input.numel() * op.input.element_size();
  if (W == 1 || nbytes == 0) return;
  GlooTransfers ex(*this, CollectiveKind::kBroadcast);
  char* data = bytes_of(op.input);
  if (r == op.root) {
    for (int p = 0; p < W; ++p) {
      if (p != r) ex.send(data, nbytes, p, slot_of(seq, 0));
    }
  } else {
    ex.recv(data, nbytes, op.root, slot_of(seq, 0));
  }
  ex.wait_all();
}

// Every rank sends a one-byte token to every other and waits for all of theirs.
void GlooProcessGroup::barrier(int64_t seq) {
  const int W = size(), r = rank();
  if (W == 1) return;
  char token = 1;
  std::vector<char> tokens(W, 0);
  GlooTransfers ex(*this, CollectiveKind::kBarrier);
  for (int p = 0; p < W; ++p) {
    if (p == r) continue;
    ex.recv(&tokens[p], 1, p, slot_of(seq, 0));
    ex.send(&token, 1, p, slot_of(seq, 0));
  }
  ex.wait_all();
}

}  // namespace comm
}  // namespace fsdp
