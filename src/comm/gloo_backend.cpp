// The CPU collectives. Where data moves: the algorithm functions below, each run on the
// group's communication thread (QueuedProcessGroup). Who waits: the caller, through Work::wait().
//
// The transport is c10d's ProcessGroupGloo, used for its point-to-point send and recv only.
// This is the library's one file that includes its header, which names a few gloo types: PyTorch's
// wheel and archive ship no gloo headers, so src/comm/gloo_names/ declares those names and
// nothing more (see its README). Nothing here constructs, derives from or calls into a gloo
// type; every call goes through c10d's exported Backend interface.
#include "src/comm/gloo_backend.h"

#include "src/comm/p2p_algorithms.h"
#include "src/comm/progress_board.h"
#include "src/util/tensor_bytes.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <link.h>

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

std::string ranks_str(const std::vector<int>& ranks) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < ranks.size(); ++i) s << (i ? ", " : "") << ranks[i];
  s << "]";
  return s.str();
}

// c10d's tags are non-negative 32-bit ints; slot_of() numbers the transfers of one operation in
// 64 bits (sequence number, step, segment). Only the transfers of the operation being executed
// are in flight on a pair at once, so the low bits of each part are enough to tell them apart.
int tag_of(uint64_t slot) {
  const uint64_t seq = slot >> 28, step = (slot >> 16) & 0xFFF, segment = slot & 0xFFFF;
  return static_cast<int>(((seq & 0x7F) << 24) | ((step & 0xFFF) << 12) | (segment & 0xFFF));
}

// A byte range as the uint8 tensor c10d's send and recv take; it borrows the memory.
at::Tensor byte_tensor(char* ptr, size_t nbytes) {
  return at::from_blob(ptr, {static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte));
}

// A second gloo in the process (a libgloo beside the one inside libtorch_cpu) would give two
// definitions of every gloo symbol and corrupt memory silently; the build refuses to link one,
// and this catches one that a plugin or LD_PRELOAD brought in.
int find_separate_gloo(struct dl_phdr_info* info, size_t, void* found) {
  const char* name = info->dlpi_name;
  if (name != nullptr && std::strstr(name, "/libgloo") != nullptr) {
    *static_cast<std::string*>(found) = name;
    return 1;
  }
  return 0;
}

void refuse_a_second_gloo() {
  std::string found;
  dl_iterate_phdr(find_separate_gloo, &found);
  TORCH_CHECK(found.empty(), "fsdp: this process has loaded a separate gloo library (", found,
              ") beside the gloo inside LibTorch's libtorch_cpu; two copies of gloo corrupt memory. "
              "Remove it from the link line, LD_PRELOAD and LD_LIBRARY_PATH.");
}

c10::intrusive_ptr<c10d::Backend> connect_gloo(const GlooGroupConfig& config, int size) {
  auto options = c10d::ProcessGroupGloo::Options::create(config.timeout);
  options->devices.push_back(config.transport_iface.empty()
                                 ? c10d::ProcessGroupGloo::createDeviceForHostname(config.transport_host)
                                 : c10d::ProcessGroupGloo::createDeviceForInterface(config.transport_iface));
  // Its worker threads run c10d's own collectives, which this backend does not use.
  options->threads = 1;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(config.store, config.rank, size, options);
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
    post(sends_, const_cast<char*>(ptr), nbytes, peer, slot, /*is_send=*/true);
  }

  void recv(char* ptr, size_t nbytes, int peer, uint64_t slot) override {
    post(recvs_, ptr, nbytes, peer, slot, /*is_send=*/false);
  }

  // A transfer that does not complete by the deadline throws a plain exception: execute() turns
  // it (like any other failure of an algorithm) into the CollectiveError that names the op and
  // the absent ranks.
  void wait_recvs(const std::function<void(char*, size_t)>& on_segment) override {
    for (auto& r : recvs_) {
      if (!r.work->wait(remaining())) throw std::runtime_error("receive aborted");
      group_.count_bytes(kind_, 0, static_cast<int64_t>(r.nbytes));
      on_segment(r.ptr, r.nbytes);
    }
    recvs_.clear();
  }
  using Transfers::wait_recvs;

  void wait_sends() override {
    for (auto& s : sends_) {
      if (!s.work->wait(remaining())) throw std::runtime_error("send aborted");
      group_.count_bytes(kind_, static_cast<int64_t>(s.nbytes), 0);
    }
    sends_.clear();
  }

 private:
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    char* ptr;
    size_t nbytes;
  };

  void post(std::vector<Pending>& pending, char* ptr, size_t nbytes, int peer, uint64_t slot, bool is_send) {
    for (size_t off = 0, seg = 0; off < nbytes; off += kSegmentBytes, ++seg) {
      const size_t len = std::min(kSegmentBytes, nbytes - off);
      std::vector<at::Tensor> piece{byte_tensor(ptr + off, len)};
      const int tag = tag_of(slot + seg);
      auto work = is_send ? group_.peers_->send(piece, peer, tag) : group_.peers_->recv(piece, peer, tag);
      pending.push_back({std::move(work), ptr + off, len});
    }
  }

  // Rounded up, so that a transfer Gloo gives up on has really outlived the deadline and the
  // error says "timed out" (truncating let Gloo stop up to 1 ms early).
  std::chrono::milliseconds remaining() const {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(group_.deadline_ - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }

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
    refuse_a_second_gloo();
    try {
      peers_ = connect_gloo(config_, size());
      wait_until_every_member_connected();
    } catch (const std::exception& e) {
      throw CollectiveError("fsdp: could not connect process group '" + name() + "' (global ranks " +
                            ranks_str(global_ranks()) + ") within " + std::to_string(timeout().count()) +
                            " ms: " + e.what() +
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
  msg << "fsdp: " << to_string(op.kind) << " #" << seq << " on process group '" << name() << "' (global ranks "
      << ranks_str(global_ranks()) << ", this is group rank " << rank() << ") ";
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
