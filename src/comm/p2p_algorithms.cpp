// The point-to-point collective algorithms. Where data moves: the transfers each step posts on
// the backend's transport. Who waits: each step, for its own transfers, before the next.
#include "src/comm/p2p_algorithms.h"

#include <fsdp/chunk.h>

#include <ATen/Functions.h>

#include <algorithm>
#include <cstring>

namespace fsdp {
namespace comm {
namespace {

// All-reduces up to this size gather every rank's copy and reduce locally (one round trip);
// larger ones use a ring reduce-scatter followed by an all-gather (bandwidth-optimal).
constexpr size_t kSmallAllReduceBytes = size_t{64} << 10;

int mod(int a, int n) { return ((a % n) + n) % n; }

std::vector<int64_t> prefix_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) off[i] = off[i - 1] + counts[i - 1];
  return off;
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

}  // namespace

std::vector<int64_t> chunk_counts(int64_t n, int parts) {
  std::vector<int64_t> counts(parts);
  for (int i = 0; i < parts; ++i) counts[i] = chunk_bounds(n, parts, i).length;
  return counts;
}

void Transfers::wait_recvs() {
  wait_recvs([](char*, size_t) {});
}

void Transfers::wait_all() {
  wait_recvs();
  wait_sends();
}

// Transfers of one operation are told apart by slot: sequence number, algorithm step, piece.
uint64_t slot_of(int64_t seq, int step) {
  return (static_cast<uint64_t>(seq) << 28) | (static_cast<uint64_t>(step) << 16);
}

void direct_all_gather(const Transport& t, char* out, const char* in, const std::vector<int64_t>& counts, size_t es) {
  const int W = t.size, r = t.rank;
  const std::vector<int64_t> off = prefix_offsets(counts);
  const size_t own = counts[r] * es;
  if (own > 0 && out + off[r] * es != in) std::memcpy(out + off[r] * es, in, own);
  if (W == 1) return;
  auto ex = t.transfers();
  for (int p = 0; p < W; ++p) {
    if (p != r && counts[p] > 0) ex->recv(out + off[p] * es, counts[p] * es, p, slot_of(t.seq, 0));
  }
  for (int p = 0; p < W && own > 0; ++p) {
    if (p != r) ex->send(in, own, p, slot_of(t.seq, 0));
  }
  ex->wait_all();
}

// At step s rank r sends the partial sum of piece (r - s - 1) to its right neighbour and
// receives the partial of piece (r - s - 2) from its left, adding its own input piece to it;
// after W - 1 steps the piece it holds is its own, fully reduced, and it landed directly in
// `output`.
void ring_reduce_scatter(const Transport& t, char* out, const char* in, const std::vector<int64_t>& counts,
                         at::ScalarType dtype, ReduceOp op) {
  const int W = t.size, r = t.rank;
  const size_t es = c10::elementSize(dtype);
  const std::vector<int64_t> off = prefix_offsets(counts);
  if (W == 1) {
    if (counts[0] > 0) std::memcpy(out, in, counts[0] * es);
    return;
  }
  const int64_t max_count = *std::max_element(counts.begin(), counts.end());
  char* partial[2] = {nullptr, nullptr};
  if (W > 2) {
    partial[0] = t.scratch(2 * max_count * es);
    partial[1] = partial[0] + max_count * es;
  }
  const int right = mod(r + 1, W), left = mod(r - 1, W);
  for (int s = 0; s < W - 1; ++s) {
    const int send_idx = mod(r - s - 1, W), recv_idx = mod(r - s - 2, W);
    const char* send_ptr = s == 0 ? in + off[send_idx] * es : partial[(s - 1) % 2];
    char* dest = s == W - 2 ? out : partial[s % 2];
    const char* local = in + off[recv_idx] * es;
    auto ex = t.transfers();
    if (counts[recv_idx] > 0) ex->recv(dest, counts[recv_idx] * es, left, slot_of(t.seq, s));
    if (counts[send_idx] > 0) ex->send(send_ptr, counts[send_idx] * es, right, slot_of(t.seq, s));
    ex->wait_recvs([&](char* seg, size_t nbytes) {
      reduce_into(seg, local + (seg - dest), static_cast<int64_t>(nbytes / es), dtype, op);
    });
    ex->wait_sends();
  }
  finish_avg(out, counts[r], dtype, op, W);
}

// As ring_reduce_scatter, but the partial sums arrive in a scratch piece and are added into the
// data in place; the input pieces of others are overwritten with partial sums on the way.
void ring_reduce_scatter_in_place(const Transport& t, char* data, const std::vector<int64_t>& counts,
                                  at::ScalarType dtype, ReduceOp op) {
  const int W = t.size, r = t.rank;
  const size_t es = c10::elementSize(dtype);
  if (W == 1) return;
  const std::vector<int64_t> off = prefix_offsets(counts);
  char* incoming = t.scratch(*std::max_element(counts.begin(), counts.end()) * es);
  const int right = mod(r + 1, W), left = mod(r - 1, W);
  auto ex = t.transfers();
  for (int s = 0; s < W - 1; ++s) {
    const int send_idx = mod(r - s - 1, W), recv_idx = mod(r - s - 2, W);
    char* target = data + off[recv_idx] * es;
    if (counts[recv_idx] > 0) ex->recv(incoming, counts[recv_idx] * es, left, slot_of(t.seq, s));
    if (counts[send_idx] > 0) ex->send(data + off[send_idx] * es, counts[send_idx] * es, right, slot_of(t.seq, s));
    ex->wait_recvs([&](char* seg, size_t nbytes) {
      reduce_into(target + (seg - incoming), seg, static_cast<int64_t>(nbytes / es), dtype, op);
    });
    ex->wait_sends();
  }
  finish_avg(data + off[r] * es, counts[r], dtype, op, W);
}

void all_reduce(const Transport& t, char* data, int64_t n, at::ScalarType dtype, ReduceOp op) {
  const int W = t.size, r = t.rank;
  const size_t es = c10::elementSize(dtype);
  if (W == 1 || n == 0) return;
  auto ex = t.transfers();
  if (n * es <= kSmallAllReduceBytes || n < W) {
    char* copies = t.scratch(W * n * es);
    std::memcpy(copies + r * n * es, data, n * es);
    for (int p = 0; p < W; ++p) {
      if (p == r) continue;
      ex->recv(copies + p * n * es, n * es, p, slot_of(t.seq, 0));
      ex->send(data, n * es, p, slot_of(t.seq, 0));
    }
    ex->wait_all();
    std::memcpy(data, copies, n * es);
    for (int p = 1; p < W; ++p) reduce_into(data, copies + p * n * es, n, dtype, op);
    finish_avg(data, n, dtype, op, W);
    return;
  }
  const std::vector<int64_t> counts = chunk_counts(n, W);
  ring_reduce_scatter_in_place(t, data, counts, dtype, op);
  const std::vector<int64_t> off = prefix_offsets(counts);
  for (int p = 0; p < W; ++p) {
    if (p == r) continue;
    if (counts[p] > 0) ex->recv(data + off[p] * es, counts[p] * es, p, slot_of(t.seq, W));
    if (counts[r] > 0) ex->send(data + off[r] * es, counts[r] * es, p, slot_of(t.seq, W));
  }
  ex->wait_all();
}

}  // namespace comm
}  // namespace fsdp
