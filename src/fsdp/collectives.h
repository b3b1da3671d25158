// collectives.h — every buffer layout of FSDP's communication, and the one place that issues
// its collectives. Stateless: the parameter group (param_group.h) decides when to gather and
// reduce; these functions decide where each byte goes. They never wait for a collective.
//
// The layouts, for a group of parameters p_0 .. p_{n-1} over W ranks. Each parameter is cut
// into W pieces by torch.chunk's rule on dim 0, every piece padded to ceil(d0 / W) rows, so a
// piece has the same size on every rank:
//
//   flat shard (this rank r)   [ p_0 piece r | p_1 piece r | ... ]           one row
//   all-gather output          row q = rank q's flat shard                     W rows ("rank-major")
//   unsharded p_i              [ p_i piece 0 | p_i piece 1 | ... ]             real data = the prefix
//   reduce-scatter input       the all-gather output's layout over the reduced parameters only
//                              (those with a gradient), filled from their unsharded grads
//   reduce-scatter output      one row of that layout; each reduced sharded grad is a view into it
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

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdp {
namespace detail {

// A flat buffer of `parts` equal rows; row q holds piece q of every parameter, in group order.
struct RankMajorLayout {
  int64_t parts = 0;
  std::vector<int64_t> piece_numel;  // per parameter: its piece in every row
  std::vector<int64_t> offset;       // per parameter: where its piece starts within a row
  int64_t row_numel = 0;             // the sum of piece_numel

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
// of its piece. Needs the unsharded data present. Not collective.
at::Tensor init_flat_shard(const FSDPParams& params, const RankMajorLayout& layout);

struct AllGatherResult {
  WorkHandle work;          // null when nothing is in flight (a group of one rank)
  at::Tensor output;        // rank-major, `layout.numel()` elements; undefined: no all-gather
  RankMajorLayout layout;   // of `output`
};

// The all-gather input of a flat shard: the shard itself, or its copy on the compute device
// (CPU offload) cast to `dtype` (mixed precision), a new buffer.
at::Tensor all_gather_input(const at::Tensor& flat_shard, at::ScalarType dtype, const GroupDevices& devices);
// Issues the all-gather of `input` (one row of `layout`; this rank's row) over `group`, into a
// new output buffer. Collective over `group`; returns at once. On one rank nothing is issued and
// the output is the input.
AllGatherResult foreach_all_gather(const at::Tensor& input, const RankMajorLayout& layout, ProcessGroup& group);
// After the all-gather finished: copies each parameter's pieces, in row order, into its
// unsharded storage (which must be allocated, padded_full_numel elements).
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

struct ReduceScatterResult {
  WorkHandle work;    // null when nothing was issued (a group of one rank)
  at::Tensor output;  // this rank's reduced padded shards of `params`, one row of `layout` (reduce dtype)
  double post_divide = 1.0;  // what the output still has to be divided by (fp16: see gradient_division)
  ReducedParams params;      // which of the group's parameters the output holds
  RankMajorLayout layout;    // of the reduce-scatter input; `output` is one of its rows
};

// How the mean over `world` ranks is taken in `reduce_dtype`. fp32 and bf16 average in the
// collective. fp16 could overflow while summing, so its input is divided by `pre` first and the
// output by `post` after (pre * post = world; pre about sqrt(world)), both with a SUM.
struct GradientDivision {
  ReduceOp op;
  double pre;
  double post;
};
GradientDivision gradient_division(at::ScalarType reduce_dtype, int64_t world);

// Reduces the unsharded gradients of the `reduced` parameters over `group` in `dtypes.reduce`
// (the mean over its ranks, like PyTorch's FSDP) and releases them. Over several ranks: copies
// them into a rank-major reduce-scatter input laid out by reduce_scatter_layout (a reduced
// parameter without a gradient contributes zeros: see set_reduce_scatter_unused_params) and
// issues the reduce-scatter; the caller waits, then calls foreach_reduce_copy_out. On one rank
// the gradient is the shard's: it is cast (through the reduce dtype) and handed to the sharded
// leaf at once (zeros for a reduced parameter without one), and nothing is issued. Every rank
// must pass the same `reduced` (sizes must match). Collective over `group`; returns at once.
ReduceScatterResult foreach_reduce(const FSDPParams& params, const ReducedParams& reduced, ProcessGroup& group,
                                   const GroupDtypes& dtypes, const GroupDevices& devices);
// The reduce-scatter input in `reduce_dtype`: the all-gather layout of the reduced subset in
// reverse, row q = piece q of every reduced parameter's unsharded gradient (zeros for one
// without a gradient). Releases those unsharded gradients.
at::Tensor foreach_reduce_copy_in(const FSDPParams& params, const ReducedParams& reduced,
                                  const RankMajorLayout& layout, at::ScalarType reduce_dtype);
// After the reduce-scatter finished: finishes the division, casts the output to `orig_dtype` on
// the shards' device (host memory under CPU offload) and gives each parameter of
// `result.params` a gradient that is a view of its piece (padding left out), or adds it to the
// existing one.
void foreach_reduce_copy_out(const ReduceScatterResult& result, const FSDPParams& params, at::ScalarType orig_dtype,
                             const GroupDevices& devices);

}  // namespace detail
}  // namespace fsdp
