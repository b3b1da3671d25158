// collectives.h — every buffer layout of FSDP's communication, and the one place that issues
// its collectives. Stateless: the parameter group (param_group.h) decides when to gather and
// reduce; these functions decide where each byte goes. They never wait for a collective.
//
// The layouts, for a group of parameters p_0 .. p_{n-1} over W ranks. Each parameter is cut
// into W pieces by torch.chunk's rule on its shard dim (dim 0 unless shard_placement_fn chose
// another), every piece padded to ceil(d / W) indices (padding only ever exists on dim 0: other
// dims split evenly), so a piece has the same size on every rank. A piece is stored contiguous,
// as its own tensor of the sharded shape:
//
//   flat shard (this rank r)   [ p_0 piece r | p_1 piece r | ... ]           one row
//   all-gather output          row q = rank q's flat shard                     W rows ("rank-major")
//   unsharded p_i, dim 0       [ p_i piece 0 | p_i piece 1 | ... ]             real data = the prefix
//   unsharded p_i, dim d > 0   the pieces concatenated along d (the tensor's own row-major
//                              layout): for each index of the dims before d, one run of every
//                              piece in turn, so copying a piece in or out moves `runs` runs
//   reduce-scatter input       the all-gather output's layout over the reduced parameters only
//                              (those with a gradient), filled from their unsharded grads
//   reduce-scatter output      one row of that layout; each reduced sharded grad is a view into it
//   all-reduce (HSDP)          the reduce-scatter output, in place, over the replicate group
//                              (W above is the shard group's size)
//
// reshard_after_forward = k (1 < k < W) keeps, between forward and backward, this rank's 1/k of
// every unsharded parameter ("post-forward shard", one row of the same rank-major layout over k
// rows), and all-gathers it among k ranks in backward.
//
// Dtypes (common.h GroupDtypes): the flat shard has the parameters' own dtype; the all-gather,
// the unsharded parameters and the post-forward shard have the compute dtype (a mixed-precision
// param_dtype: the flat shard is cast into the all-gather input); the reduce-scatter runs in the
// reduce dtype (gradients are cast into its input) and its output is cast back to the flat
// shard's dtype before the sharded gradients view it. A device path with its own streams
// changes these functions only.
#pragma once

#include "src/fsdp/common.h"
#include "src/fsdp/fsdp_param.h"
#include "src/tensor/quantized_all_reduce.h"

#include <fsdp/custom_comm.h>
#include <fsdp/process_group.h>
#include <fsdp/quantized_comm.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fsdp {
namespace detail {

// A flat buffer of `parts` equal rows; row q holds piece q of every parameter, in group order.
struct RankMajorLayout {
  int64_t parts = 0;
  std::vector<int64_t> piece_numel;  // per parameter: its piece in every row
  std::vector<int64_t> offset;       // per parameter: where its piece starts within a row
  // Per parameter: in how many equal runs its piece lies in the unsharded tensor; run o of
  // piece q starts at element (o * parts + q) * (piece_numel / runs) there. 1 for dim 0 and
  // for the post-forward layout (a piece is one slice of the unsharded storage).
  std::vector<int64_t> runs;
  int64_t row_numel = 0;  // the sum of piece_numel

  int64_t numel() const { return parts * row_numel; }
};

// The layout of the all-gather and reduce-scatter over all `world` ranks of the shard group:
// pieces are the padded shards.
RankMajorLayout shard_layout(const FSDPParams& params, int64_t world);
// The layout of the backward all-gather among the k ranks of a post-forward group: pieces are
// 1/k of each unsharded (padded) parameter.
RankMajorLayout post_forward_layout(const FSDPParams& params, int64_t k);

// Allocates this rank's flat shard (one row of `layout`), copies this rank's rows of every
// unsharded parameter into it (zero padding after them), and makes each sharded leaf a view
// of its piece. Needs the unsharded data present. Not collective. The flat shard is made on the
// parameters' device and moved to `devices.shard` (host memory under CPU offload, pinned when
// `devices.non_blocking`).
at::Tensor init_flat_shard(const FSDPParams& params, const RankMajorLayout& layout,
                           const GroupDevices& devices = GroupDevices{c10::Device(c10::DeviceType::CPU),
                                                                      c10::Device(c10::DeviceType::CPU), false, false});

struct AllGatherResult {
  WorkHandle work;         // null when nothing is in flight (a group of one rank)
  at::Tensor output;       // rank-major, `layout.numel()` elements; undefined: no all-gather
  RankMajorLayout layout;  // of `output`
  // On a device: the stream the buffers were allocated on (the copy-in stream) and the one the
  // collective was issued from, whose event the compute stream waits for. Unset on the CPU.
  std::optional<c10::Stream> alloc_stream;
  std::optional<c10::Stream> issue_stream;
  // quantized_weights: `output` holds every rank's encoded row (bytes), decoded by the copy-out.
  std::optional<QuantizedComm> quantized = std::nullopt;
};

// The all-gather input of a flat shard: the shard itself, or its copy on the compute device
// (CPU offload) cast to `dtype` (mixed precision), a new buffer.
at::Tensor all_gather_input(const at::Tensor& flat_shard, at::ScalarType dtype, const GroupDevices& devices);
// Issues the all-gather of `input` (one row of `layout`; this rank's row) over `group`, into a
// new output buffer. Collective over `group`; returns at once. On one rank nothing is issued and
// the output is the input. With `custom` (FSDPModule::set_custom_all_gather), the input is
// copied into a buffer of its allocate(), the output is another, and it runs the collective.
// Buffers are allocated on the current stream; with `issue_stream` (a device's all-gather
// stream) the collective is issued from that stream, after it waited for the current one.
AllGatherResult foreach_all_gather(const at::Tensor& input, const RankMajorLayout& layout, ProcessGroup& group,
                                   AllGather* custom = nullptr,
                                   const std::optional<c10::Stream>& issue_stream = std::nullopt);
// The quantized all-gather (FullyShardOptions::quantized_weights): encodes `input` (this rank's
// row, in the shards' dtype) as `format` says and all-gathers the encoded rows over `group` into
// a new byte buffer; the copy-out decodes every row, this rank's included, so every rank holds
// the same unsharded values. Collective over `group` (more than one rank); returns at once.
AllGatherResult foreach_all_gather_quantized(const at::Tensor& input, const RankMajorLayout& layout,
                                             ProcessGroup& group, const QuantizedComm& format,
                                             const std::optional<c10::Stream>& issue_stream = std::nullopt);
// After the all-gather finished: copies each parameter's pieces, in row order, into its
// unsharded storage (which must be allocated, padded_full_numel elements), decoding them first
// when the all-gather was quantized.
void foreach_all_gather_copy_out(const AllGatherResult& result, const FSDPParams& params);

// Copies piece `index` of every unsharded parameter (as cut by `layout`, a post-forward layout)
// into a new flat buffer: the input of the backward all-gather among the post-forward group.
at::Tensor copy_post_forward_shard(const FSDPParams& params, const RankMajorLayout& layout, int64_t index);

// The parameters one reduce-scatter carries: indices into the group's params, in group order.
// Only these get a sharded gradient from it; the others' gradients are left as they are.
using ReducedParams = std::vector<size_t>;

// The layout of a reduce-scatter over `world` ranks that carries `reduced` of `params`: the
// shard layout of that subset (a parameter left out takes no room in any row).
RankMajorLayout reduce_scatter_layout(const FSDPParams& params, const ReducedParams& reduced, int64_t world);

// How a group's gradients are divided, PyTorch FSDP2's rule. S = shard group size, R = replicate
// group size (HSDP; 1 otherwise), N = S * R, F = the user's divide factor
// (FSDPModule::set_gradient_divide_factor). "Overflow risk" = a reduce dtype other than fp32/bf16.
//
//   case                                       pre-divide  post-divide  reduce-scatter      all-reduce
//   fp32/bf16, not forced to sum, no F, N = 1  -           -            SUM                 SUM
//   fp32/bf16, not forced to sum, no F, N > 1  -           -            AVG                 AVG
//   fp32/bf16, not forced to sum, F given      -           -            AVG if F == S,      SUM
//                                                                       else PREMUL_SUM(1/F)
//   forced to sum (fp32/bf16), F' = F or N     -           F'           SUM                 SUM
//   overflow risk (fp16), F' = F or N          p           F' / p       SUM                 SUM
//
// p starts at 1 and doubles while F' is divisible by p and F' / p > p (about sqrt(F'), so an fp16
// sum neither overflows nor underflows). The result is the mean over all N ranks without F, the
// sum over them divided by F with it. ProcessGroup has no PREMUL_SUM (NCCL's "multiply each
// input by a scalar, then sum"): it is done exactly as defined, the reduce-scatter input
// multiplied by `premul` = 1/F and then a SUM.
struct GradientDivision {
  double pre_divide = 1.0;  // the reduce-scatter input is divided by it first
  double premul = 1.0;      // then multiplied by it (PREMUL_SUM's scalar; 1 when not used)
  ReduceOp reduce_scatter_op = ReduceOp::kSum;
  ReduceOp all_reduce_op = ReduceOp::kSum;
  double post_divide = 1.0;  // the reduced output is divided by it last

  // True when the reduction of a single rank is the identity (nothing divided, nothing scaled).
  bool is_identity() const { return pre_divide == 1.0 && premul == 1.0 && post_divide == 1.0; }
};
GradientDivision gradient_division(at::ScalarType reduce_dtype, int64_t shard_size, int64_t replicate_size,
                                   std::optional<double> divide_factor, bool force_sum_reduction);

struct ReduceScatterResult {
  WorkHandle work;            // null when nothing was issued (a shard group of one rank)
  at::Tensor input;           // kept until the compute stream waited for the collective (a device)
  at::Tensor output;          // this rank's reduced padded shards of `params`, one row of `layout` (reduce dtype)
  GradientDivision division;  // what was applied, and what the output still needs (post_divide)
  ReducedParams params;       // which of the group's parameters the output holds
  RankMajorLayout layout;     // of the reduce-scatter input; `output` is one of its rows
};

// Reduces the unsharded gradients of the `reduced` parameters over `group` in `reduce_dtype`,
// divided as `division` says, and releases them: copies them into a rank-major reduce-scatter
// input laid out by reduce_scatter_layout (a reduced parameter without a gradient contributes
// zeros: see set_reduce_scatter_unused_params), applies the pre-division, and issues the
// reduce-scatter; the caller waits, then calls foreach_reduce_copy_out. On a group of one rank
// the input (one row) is the output and nothing is issued. Every rank must pass the same
// `reduced` (sizes must match). Collective over `group`; returns at once. With `custom`
// (FSDPModule::set_custom_reduce_scatter) both buffers come from its allocate() and it runs the
// collective.
ReduceScatterResult foreach_reduce(const FSDPParams& params, const ReducedParams& reduced, ProcessGroup& group,
                                   at::ScalarType reduce_dtype, const GradientDivision& division,
                                   ReduceScatter* custom = nullptr);
// foreach_reduce in its two halves, for a device, where they run on different streams: the
// copy-in (on the compute stream, which made the gradients and frees them), then the division
// and the collective (on the reduce-scatter stream).
struct ReduceScatterInput {
  RankMajorLayout layout;
  at::Tensor input;
};
ReduceScatterInput foreach_reduce_prepare(const FSDPParams& params, const ReducedParams& reduced, int64_t world,
                                          at::ScalarType reduce_dtype, ReduceScatter* custom);
ReduceScatterResult foreach_reduce_issue(ReduceScatterInput prepared, const ReducedParams& reduced, ProcessGroup& group,
                                         const GradientDivision& division, ReduceScatter* custom);
// On a shard group of one rank with nothing else to do (no all-reduce, no division, no hook):
// each unsharded gradient of the `reduced` parameters has the shard's shape already, so it is
// cast (through the reduce dtype, as a reduction would) and handed to the sharded leaf at once,
// without a copy when no cast or offload is needed (zeros for a reduced parameter without
// one). Under CPU offload it is copied to host memory on the current stream: with `may_run_on`
// (the caller records an event that the host synchronizes on before the gradients are read) a
// copy into pinned memory runs on while the host goes on, unless a gradient there is about to be
// added to. Returns whether such a copy was issued. Not collective.
bool foreach_reduce_hand_over(const FSDPParams& params, const ReducedParams& reduced, const GroupDtypes& dtypes,
                              const GroupDevices& devices, bool may_run_on);
// The reduce-scatter input in `reduce_dtype`: the all-gather layout of the reduced subset in
// reverse, row q = piece q of every reduced parameter's unsharded gradient (zeros for one
// without a gradient). Releases those unsharded gradients. The buffer comes from `allocator`
// when given (a custom reduce-scatter's).
at::Tensor foreach_reduce_copy_in(const FSDPParams& params, const ReducedParams& reduced, const RankMajorLayout& layout,
                                  at::ScalarType reduce_dtype, CommBufferAllocator* allocator = nullptr);
// HSDP: issues the all-reduce of a reduce-scatter's output, in place, over the replicate group
// with `division.all_reduce_op`. The output must be complete, or be written by `after` (the
// reduce-scatter itself: the all-reduce then starts once it finished; see
// ProcessGroup::all_reduce). Collective over `replicate_group`; returns at once (on a CPU
// backend it runs on that group's own communication thread, beside the shard group's).
WorkHandle foreach_all_reduce(const ReduceScatterResult& reduced, ProcessGroup& replicate_group,
                              WorkHandle after = nullptr);
// HSDP's all-reduce with FullyShardOptions::quantized_gradients, issued once the reduce-scatter
// output is complete (its input is encoded first). bf16: an all-reduce (SUM) of the bf16 row;
// int8 and fp8: an all-gather of every replica's encoded row, summed in fp32 in replica order by
// finish_all_reduce_quantized, so every replica gets bitwise the same sum. `residual` (undefined:
// no error feedback) is this rank's fp32 residual in the layout `full` (the group's shard
// layout): the reduced parameters' pieces of it are added to the input and replaced by what the
// encoding lost. `skip`: the group's skip_zero_blocks state (required with that option).
// Collective over `replicate_group`; returns at once, except that a reduction of nonzero blocks
// only first waits for every replica's block count (quantized_all_reduce.h).
QuantizedAllReduce foreach_all_reduce_quantized(const ReduceScatterResult& reduced, ProcessGroup& replicate_group,
                                                const QuantizedComm& format, const at::Tensor& residual,
                                                const RankMajorLayout& full, ZeroBlockSkip* skip);
// After its collective finished: writes the replicas' reduction into `reduced.output`.
void finish_all_reduce_quantized(const QuantizedAllReduce& quantized, const ReduceScatterResult& reduced);
// After the reduce-scatter finished: finishes the division, casts the output to `orig_dtype` on
// the shards' device (host memory under CPU offload) and gives each parameter of
// `result.params` a gradient that is a view of its piece (padding left out), or adds it to the
// existing one.
void foreach_reduce_copy_out(const ReduceScatterResult& result, const FSDPParams& params, at::ScalarType orig_dtype,
                             const GroupDevices& devices);

}  // namespace detail
}  // namespace fsdp
