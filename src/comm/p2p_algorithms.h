// p2p_algorithms.h — the collective algorithms fsdp-cpp runs itself on point-to-point
// transfers: a direct-exchange all-gather, a ring reduce-scatter (out of place or in place),
// and an all-reduce. The Gloo backend runs every collective with them; the MPI backend runs its
// large reduce-scatters and all-reduces with the ring (see mpi_backend.cpp for why).
//
// A backend supplies the transport (Transfers: posting byte-range sends and receives and waiting
// for them) and a scratch area; the algorithms own who sends what to whom, in which step, and the
// arithmetic of reductions (through ATen, so values combine as ATen would combine them).
// Everything here runs on the group's communication thread and allocates nothing per call.
#pragma once

#include <fsdp/process_group.h>

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace fsdp {
namespace comm {

// The point-to-point transfers of one algorithm step on a backend's transport. send/recv post
// a transfer and return at once; the waits return when every posted transfer is done and throw
// when one fails (the backend's execute() turns that into its CollectiveError).
class Transfers {
 public:
  virtual ~Transfers() = default;
  // `slot` tells one operation's transfers apart (slot_of below), for transports that match
  // transfers by tag rather than by posting order.
  virtual void send(const char* ptr, size_t nbytes, int peer, uint64_t slot) = 0;
  virtual void recv(char* ptr, size_t nbytes, int peer, uint64_t slot) = 0;
  // Waits for the receives in posting order; `on_landed(ptr, nbytes)` runs for each piece as it
  // lands (a transport may split a transfer into pieces), so the caller can reduce one piece
  // while later ones are still in flight.
  virtual void wait_recvs(const std::function<void(char*, size_t)>& on_landed) = 0;
  virtual void wait_sends() = 0;

  void wait_recvs();
  void wait_all();
};

// What the algorithms run on: this rank's place in the group, the operation's sequence number,
// a new set of Transfers per algorithm step, and the group's scratch area (kept between calls).
struct Transport {
  int rank = 0;
  int size = 1;
  int64_t seq = 0;
  std::function<std::unique_ptr<Transfers>()> transfers;
  std::function<char*(size_t)> scratch;
};

// The slot of the transfers of operation `seq` at algorithm step `step`; a transport that splits
// a transfer into pieces numbers them slot + 0, slot + 1, ...
uint64_t slot_of(int64_t seq, int step);

// output = the concatenation of every rank's piece (rank i's is counts[i] elements at offset
// counts[0] + ... + counts[i - 1]); `input` is this rank's piece and may be its slice of output.
// Every rank sends its piece to every other straight into their output.
void direct_all_gather(const Transport& t, char* output, const char* input, const std::vector<int64_t>& counts,
                       size_t element_size);

// output = op over all ranks of this rank's piece of `input` (pieces laid out as above); input
// is left alone. Sends exactly the W - 1 pieces of others, keeps at most two pieces of scratch.
void ring_reduce_scatter(const Transport& t, char* output, const char* input, const std::vector<int64_t>& counts,
                         at::ScalarType dtype, ReduceOp op);

// In place: rank i's piece of `data` (laid out as above) becomes op over all ranks of that
// piece; the other pieces are left holding partial results. One piece of scratch.
void ring_reduce_scatter_in_place(const Transport& t, char* data, const std::vector<int64_t>& counts,
                                  at::ScalarType dtype, ReduceOp op);

// torch.chunk's split of n elements into `parts` pieces (the last ones may be short or empty):
// the pieces all_reduce reduce-scatters.
std::vector<int64_t> chunk_counts(int64_t n, int parts);

// In place: data = op over all ranks of data (n elements), bitwise the same on every rank.
// Small: every rank gathers every copy and reduces in rank order. Large: an in-place ring
// reduce-scatter over torch.chunk pieces, then a direct all-gather of the pieces.
void all_reduce(const Transport& t, char* data, int64_t n, at::ScalarType dtype, ReduceOp op);

}  // namespace comm
}  // namespace fsdp
