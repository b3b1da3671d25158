// The CPU collectives. Where data moves: the algorithm functions below, each run on the
// group's communication thread (run_loop). Who waits: the caller, through Work::wait().
#include "src/comm/gloo_backend.h"

#include "src/comm/progress_board.h"
#include "src/util/tensor_bytes.h"

#include <fsdp/flight_recorder.h>
#include <fsdp/placement.h>
#include <fsdp/trace.h>

#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
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
// All-reduces up to this size gather every rank's copy and reduce locally (one round trip);
// larger ones use a ring reduce-scatter followed by an all-gather (bandwidth-optimal).
constexpr size_t kSmallAllReduceBytes = size_t{64} << 10;

// Transfers of one operation are told apart by slot: sequence number, algorithm step, segment.
uint64_t slot_of(int64_t seq, int step) {
  return (static_cast<uint64_t>(seq) << 28) | (static_cast<uint64_t>(step) << 16);
}

int mod(int a, int n) { return ((a % n) + n) % n; }

std::vector<int64_t> prefix_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
}

// torch.chunk's split of n elements into `parts` pieces (the last ones may be short or empty).
std::vector<int64_t> chunk_counts(int64_t n, int parts) {
  std::vector<int64_t> counts(parts);
  for (int i = 0; i < parts; ++i) counts[i] = chunk_bounds(n, parts, i).length;
  return counts;
}

at::Tensor view_bytes(char* ptr, int64_t numel, at::ScalarType dtype) {
  return at::from_blob(ptr, {numel}, at::TensorOptions().dtype(dtype));
}

// dst = dst op src, elementwise over n elements.
void reduce_into(char* dst, const char* src, int64_t n, at::ScalarType dtype, ReduceOp op) {
  at::Tensor d = view_bytes(dst, n, dtype);
  at::Tensor s = view_bytes(const_cast<char*>(src), n, dtype);
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: d.add_(s); break;
    case ReduceOp::kMax: at::maximum_out(d, d, s); break;
    case ReduceOp::kMin: at::minimum_out(d, d, s); break;
  }
}

void finish_avg(char* ptr, int64_t n, at::ScalarType dtype, ReduceOp op, int world) {
  if (op == ReduceOp::kAvg && n > 0) view_bytes(ptr, n, dtype).div_(world);
}

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

// ------------------------------------------------------------------------------ Exchange

// The point-to-point transfers of one algorithm step. Sends and receives are posted at once and
// progress on Gloo's I/O thread; the waits are bounded by the operation's deadline and count
// the bytes that actually moved.
class GlooProcessGroup::Exchange {
 public:
  Exchange(GlooProcessGroup& group, CollectiveKind kind) : group_(group), kind_(kind) {}

  void send(const char* ptr, size_t nbytes, int peer, uint64_t slot) {
    for (size_t off = 0, seg = 0; off < nbytes; off += kSegmentBytes, ++seg) {
      const size_t len = std::min(kSegmentBytes, nbytes - off);
      auto buf = group_.context_->createUnboundBuffer(const_cast<char*>(ptr) + off, len);
      buf->send(peer, slot + seg, 0, len);
      sends_.push_back({std::move(buf), nullptr, len});
    }
  }

  void recv(char* ptr, size_t nbytes, int peer, uint64_t slot) {
    for (size_t off = 0, seg = 0; off < nbytes; off += kSegmentBytes, ++seg) {
      const size_t len = std::min(kSegmentBytes, nbytes - off);
      auto buf = group_.context_->createUnboundBuffer(ptr + off, len);
      buf->recv(peer, slot + seg, 0, len);
      recvs_.push_back({std::move(buf), ptr + off, len});
    }
  }

  // Waits for the receives in posting order; `on_segment(ptr, nbytes)` runs as each lands, so
  // the caller can reduce a segment while later ones are still in flight. A transfer that does
  // not complete by the deadline throws a plain exception: execute() turns it (like any other
  // failure of an algorithm) into the CollectiveError that names the op and the absent ranks.
  template <typename F>
  void wait_recvs(F&& on_segment) {
    for (auto& r : recvs_) {
      if (!r.buffer->waitRecv(nullptr, remaining())) throw std::runtime_error("receive aborted");
      group_.count_bytes(kind_, 0, static_cast<int64_t>(r.nbytes));
      on_segment(r.ptr, r.nbytes);
    }
    recvs_.clear();
  }
  void wait_recvs() {
    wait_recvs([](char*, size_t) {});
  }

  void wait_sends() {
    for (auto& s : sends_) {
      if (!s.buffer->waitSend(nullptr, remaining())) throw std::runtime_error("send aborted");
      group_.count_bytes(kind_, static_cast<int64_t>(s.nbytes), 0);
    }
    sends_.clear();
  }

  void wait_all() {
    wait_recvs();
    wait_sends();
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
    : ProcessGroup(config.rank, config.global_ranks, config.name, config.timeout),
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
  thread_ = std::thread([this] { run_loop(); });
}

GlooProcessGroup::~GlooProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  thread_.join();
}

WorkHandle GlooProcessGroup::enqueue(Op op) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  TORCH_CHECK(!stopping_, "process group '", name(), "' is being destroyed; no new collectives");
  // Sequence numbers are taken under the queue lock so that they follow queue order.
  WorkHandle work = make_work(op.kind, {op.output, op.input});
  queue_.push_back(Task{std::move(op), work});
  queue_cv_.notify_one();
  return work;
}

void GlooProcessGroup::run_loop() {
  // The algorithms reduce through ATen views of raw buffers: no autograd bookkeeping wanted.
  c10::InferenceMode no_autograd;
  trace::set_thread_name("comm " + name());
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    const int64_t seq = task.work->seq();
    if (!broken_.empty()) {
      error = std::make_exception_ptr(CollectiveError(
          std::string("fsdp: ") + to_string(task.op.kind) + " #" + std::to_string(seq) +
          " on process group '" + name() + "' was not run: the group is unusable after an earlier failure (" +
          broken_ + ")"));
    } else {
      const auto start = std::chrono::steady_clock::now();
      FlightRecorder::global().started(name(), seq);
      try {
        execute(task.op, seq);
      } catch (const std::exception&) {  // execute() throws CollectiveErrors only
        broken_ = std::string(to_string(task.op.kind)) + " #" + std::to_string(seq) + " failed";
        error = std::current_exception();
      }
      const auto end = Clock::now();
      count_busy(task.op.kind, std::chrono::duration_cast<std::chrono::nanoseconds>(end - start).count());
      if (trace::enabled()) {
        const int64_t bytes = task.op.input.defined() ? static_cast<int64_t>(task.op.input.nbytes()) : 0;
        trace::record("comm", std::string(to_string(task.op.kind)) + " #" + std::to_string(seq), start, end,
                      "{\"group\": \"" + name() + "\", \"input_bytes\": " + std::to_string(bytes) + "}");
      }
    }
    finish_work(*task.work, error);
  }
}

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

// Reused across operations: first-touching freshly mapped pages can cost more than the
// transfer itself (on a 2-vCPU VM, ~100 ms to fault in 32 MiB against ~25 ms to move it).
// Allocated through LibTorch, so memory accounting sees it.
char* GlooProcessGroup::scratch(size_t nbytes) {
  if (!scratch_.defined() || scratch_.numel() < static_cast<int64_t>(nbytes)) {
    scratch_ = at::Tensor();  // free the old one first
    scratch_ = at::empty({static_cast<int64_t>(nbytes)}, at::TensorOptions().dtype(at::kByte));
  }
  return bytes_of(scratch_);
}

// Direct exchange: every rank sends its piece to every other rank, straight into their output.
void GlooProcessGroup::all_gather(const Op& op, int64_t seq) {
  const int W = size(), r = rank();
  const size_t es = op.output.element_size();
  const std::vector<int64_t> off = prefix_offsets(op.counts);
  char* out = bytes_of(op.output);
  const char* in = bytes_of(op.input);
  const size_t own = op.counts[r] * es;
  if (own > 0 && out + off[r] * es != in) std::memcpy(out + off[r] * es, in, own);
  if (W == 1) return;
  Exchange ex(*this, CollectiveKind::kAllGather);
  for (int p = 0; p < W; ++p) {
    if (p != r && op.counts[p] > 0) ex.recv(out + off[p] * es, op.counts[p] * es, p, slot_of(seq, 0));
  }
  for (int p = 0; p < W && own > 0; ++p) {
    if (p != r) ex.send(in, own, p, slot_of(seq, 0));
  }
  ex.wait_all();
}

// Ring reduce-scatter that leaves the input untouched. At step s rank r sends the partial sum
// of chunk (r - s - 1) to its right neighbour and receives the partial of chunk (r - s - 2)
// from its left, adding its own input chunk to it; after W - 1 steps the chunk it holds is its
// own, fully reduced, and it landed directly in `output`. Each rank sends exactly the W - 1
// chunks of others (never its own) and keeps at most two chunks of scratch.
void GlooProcessGroup::reduce_scatter(const Op& op, int64_t seq) {
  const int W = size(), r = rank();
  const at::ScalarType dtype = op.output.scalar_type();
  const size_t es = op.output.element_size();
  const std::vector<int64_t> off = prefix_offsets(op.counts);
  const char* in = bytes_of(op.input);
  char* out = bytes_of(op.output);
  if (W == 1) {
    if (op.counts[0] > 0) std::memcpy(out, in, op.counts[0] * es);
    return;
  }
  const int64_t max_count = *std::max_element(op.counts.begin(), op.counts.end());
  char* partial[2] = {nullptr, nullptr};
  if (W > 2) {
    partial[0] = scratch(2 * max_count * es);
    partial[1] = partial[0] + max_count * es;
  }
  const int right = mod(r + 1, W), left = mod(r - 1, W);
  for (int s = 0; s < W - 1; ++s) {
    const int send_idx = mod(r - s - 1, W), recv_idx = mod(r - s - 2, W);
    const char* send_ptr = s == 0 ? in + off[send_idx] * es : partial[(s - 1) % 2];
    char* dest = s == W - 2 ? out : partial[s % 2];
    const char* local = in + off[recv_idx] * es;
    Exchange ex(*this, CollectiveKind::kReduceScatter);
    if (op.counts[recv_idx] > 0) ex.recv(dest, op.counts[recv_idx] * es, left, slot_of(seq, s));
    if (op.counts[send_idx] > 0) ex.send(send_ptr, op.counts[send_idx] * es, right, slot_of(seq, s));
    ex.wait_recvs([&](char* seg, size_t nbytes) {
      reduce_into(seg, local + (seg - dest), static_cast<int64_t>(nbytes / es), dtype, op.reduce);
    });
    ex.wait_sends();
  }
  finish_avg(out, op.counts[r], dtype, op.reduce, W);
}

// Small: gather every copy and reduce in rank order, so every rank computes the same bits.
// Large: in-place ring reduce-scatter over torch.chunk pieces, then an all-gather of the pieces.
void GlooProcessGroup::all_reduce(const Op& op, int64_t seq) {
  const int W = size(), r = rank();
  const at::Tensor& t = op.input;
  const at::ScalarType dtype = t.scalar_type();
  const size_t es = t.element_size();
  const int64_t n = t.numel();
  char* data = bytes_of(t);
  if (W == 1 || n == 0) return;
  Exchange ex(*this, CollectiveKind::kAllReduce);
  if (n * es <= kSmallAllReduceBytes || n < W) {
    char* copies = scratch(W * n * es);
    std::memcpy(copies + r * n * es, data, n * es);
    for (int p = 0; p < W; ++p) {
      if (p == r) continue;
      ex.recv(copies + p * n * es, n * es, p, slot_of(seq, 0));
      ex.send(data, n * es, p, slot_of(seq, 0));
    }
    ex.wait_all();
    std::memcpy(data, copies, n * es);
    for (int p = 1; p < W; ++p) reduce_into(data, copies + p * n * es, n, dtype, op.reduce);
    finish_avg(data, n, dtype, op.reduce, W);
    return;
  }
  const std::vector<int64_t> counts = chunk_counts(n, W);
  const std::vector<int64_t> off = prefix_offsets(counts);
  char* incoming = scratch(counts[0] * es);
  const int right = mod(r + 1, W), left = mod(r - 1, W);
  for (int s = 0; s < W - 1; ++s) {
    const int send_idx = mod(r - s - 1, W), recv_idx = mod(r - s - 2, W);
    char* target = data + off[recv_idx] * es;
    if (counts[recv_idx] > 0) ex.recv(incoming, counts[recv_idx] * es, left, slot_of(seq, s));
    if (counts[send_idx] > 0) ex.send(data + off[send_idx] * es, counts[send_idx] * es, right, slot_of(seq, s));
    ex.wait_recvs([&](char* seg, size_t nbytes) {
      reduce_into(target + (seg - incoming), seg, static_cast<int64_t>(nbytes / es), dtype, op.reduce);
    });
    ex.wait_sends();
  }
  finish_avg(data + off[r] * es, counts[r], dtype, op.reduce, W);
  for (int p = 0; p < W; ++p) {
    if (p == r) continue;
    if (counts[p] > 0) ex.recv(data + off[p] * es, counts[p] * es, p, slot_of(seq, W));
    if (counts[r] > 0) ex.send(data + off[r] * es, counts[r] * es, p, slot_of(seq, W));
  }
  ex.wait_all();
}

void GlooProcessGroup::broadcast(const Op& op, int64_t seq) {
  const int W = size(), r = rank();
  const size_t nbytes = op.input.numel() * op.input.element_size();
  if (W == 1 || nbytes == 0) return;
  Exchange ex(*this, CollectiveKind::kBroadcast);
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
  Exchange ex(*this, CollectiveKind::kBarrier);
  for (int p = 0; p < W; ++p) {
    if (p == r) continue;
    ex.recv(&tokens[p], 1, p, slot_of(seq, 0));
    ex.send(&token, 1, p, slot_of(seq, 0));
  }
  ex.wait_all();
}

}  // namespace comm
}  // namespace fsdp
