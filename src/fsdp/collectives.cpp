// collectives.cpp — the copy-ins and copy-outs of FSDP's buffers and the calls that issue its
// collectives (layouts drawn in collectives.h). Copies are ATen ops on views of the buffers, on
// the current stream, a few per group or per parameter (never one per rank or per run), as
// FSDP2's split_with_sizes_copy and _chunk_cat; the unsharded tensors are written in place through
// tensors of their own on the same storage, under autograd's saved views.
#include "src/fsdp/collectives.h"

#include "src/device/device_ops.h"
#include "src/tensor/quantize.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace fsdp {
namespace detail {
namespace {

// Row q holds piece q of every parameter, in order; piece_numel[i] is parameter i's piece, in
// runs[i] runs of the unsharded tensor.
RankMajorLayout layout_of(int64_t parts, std::vector<int64_t> piece_numel, std::vector<int64_t> runs) {
  RankMajorLayout layout;
  layout.parts = parts;
  layout.piece_numel = std::move(piece_numel);
  layout.runs = std::move(runs);
  for (int64_t n : layout.piece_numel) {
    layout.offset.push_back(layout.row_numel);
    layout.row_numel += n;
  }
  return layout;
}

// Piece `q` of `full` (shaped as parameter `i`'s unsharded tensor, contiguous) into the
// contiguous `dst`, cast to its dtype, zero padding after the real elements: one copy (strided
// for a shard dim > 0, whose runs lie `parts` pieces apart) and at most one zero fill.
void copy_piece_from_full(const at::Tensor& dst, const at::Tensor& full, const RankMajorLayout& layout, size_t i,
                          int64_t q) {
  const int64_t runs = layout.runs[i];
  const int64_t piece = layout.piece_numel[i];
  if (piece == 0) return;
  if (runs > 1) {  // even, no padding
    dst.view({runs, piece / runs}).copy_(full.reshape({runs, layout.parts, piece / runs}).select(1, q));
    return;
  }
  const at::Tensor flat = full.reshape({-1});
  const int64_t real = std::max<int64_t>(0, std::min(piece, flat.numel() - q * piece));
  if (real > 0) dst.narrow(0, 0, real).copy_(flat.narrow(0, q * piece, real));
  if (real < piece) dst.narrow(0, real, piece - real).zero_();
}

// Every piece of `full` (shaped as parameter `i`'s unsharded tensor; undefined: zeros) into
// `rows` ([parts, piece], row q = piece q; a strided view of a rank-major buffer), cast to its
// dtype: a copy of the whole pieces (one strided copy for a shard dim > 0), one of the last,
// partial piece, and zero fills for the padding. The number of copies does not grow with the
// number of ranks or of runs.
void copy_pieces_from_full(const at::Tensor& rows, const at::Tensor& full, const RankMajorLayout& layout, size_t i) {
  const int64_t parts = layout.parts, runs = layout.runs[i], piece = layout.piece_numel[i];
  if (piece == 0) return;
  if (!full.defined()) {
    rows.zero_();
    return;
  }
  if (runs > 1) {  // even, no padding
    const int64_t run = piece / runs;
    rows.view({parts, runs, run}).copy_(full.reshape({runs, parts, run}).permute({1, 0, 2}));
    return;
  }
  const at::Tensor flat = full.reshape({-1});
  const int64_t whole = std::min(parts, flat.numel() / piece);
  if (whole > 0) rows.narrow(0, 0, whole).copy_(flat.narrow(0, 0, whole * piece).view({whole, piece}));
  if (whole == parts) return;
  const int64_t rest = flat.numel() - whole * piece;
  at::Tensor last = rows.select(0, whole);
  if (rest > 0) last.narrow(0, 0, rest).copy_(flat.narrow(0, whole * piece, rest));
  last.narrow(0, rest, piece - rest).zero_();
  if (whole + 1 < parts) rows.narrow(0, whole + 1, parts - whole - 1).zero_();
}

// The reverse, after an all-gather: `rows` ([parts, piece]) into parameter `i`'s unsharded
// storage, in one copy (strided for a shard dim > 0). The padding is copied too: it is the
// storage's own tail.
void copy_pieces_to_unsharded(const at::Tensor& rows, const FSDPParam& p, const RankMajorLayout& layout, size_t i) {
  const int64_t parts = layout.parts, runs = layout.runs[i], piece = layout.piece_numel[i];
  if (piece == 0) return;
  const at::Tensor& unsharded = p.unsharded_storage();
  if (runs == 1) {
    unsharded.view({parts, piece}).copy_(rows);
    return;
  }
  const int64_t run = piece / runs;
  unsharded.view({runs, parts, run}).copy_(rows.view({parts, runs, run}).permute({1, 0, 2}));
}

std::vector<int64_t> runs_of(const FSDPParams& params, const std::vector<size_t>& indices) {
  std::vector<int64_t> runs;
  // An empty dim before the shard dim leaves nothing to copy: one (empty) run.
  for (size_t i : indices) runs.push_back(std::max<int64_t>(1, params.at(i)->outer_numel()));
  return runs;
}

std::vector<size_t> all_indices(const FSDPParams& params) {
  std::vector<size_t> out(params.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = i;
  return out;
}

// A buffer of a custom collective (fsdp/custom_comm.h), checked before FSDP writes to it.
at::Tensor allocate_comm_buffer(CommBufferAllocator& allocator, int64_t numel, const at::TensorOptions& options,
                                const char* what) {
  at::Tensor buffer = allocator.allocate(numel, options.dtype().toScalarType(), options.device());
  TORCH_CHECK(buffer.defined() && buffer.dim() == 1 && buffer.numel() == numel && buffer.is_contiguous() &&
                  buffer.scalar_type() == options.dtype().toScalarType() && buffer.device() == options.device(),
              "fsdp: the custom ", what, "'s allocate(", numel, ", ", options.dtype().toScalarType(), ", ",
              options.device(),
              ") must return a contiguous 1-D tensor of exactly that size, dtype and device, but "
              "returned ",
              buffer.defined() ? buffer.toString() + " of shape " + c10::str(buffer.sizes()) +
                                     (buffer.is_contiguous() ? "" : " (not contiguous)")
                               : std::string("an undefined tensor"));
  return buffer;
}

}  // namespace

RankMajorLayout shard_layout(const FSDPParams& params, int64_t world) {
  return reduce_scatter_layout(params, all_indices(params), world);
}

RankMajorLayout reduce_scatter_layout(const FSDPParams& params, const ReducedParams& reduced, int64_t world) {
  std::vector<int64_t> pieces;
  for (size_t i : reduced) pieces.push_back(params.at(i)->padded_shard_numel());
  return layout_of(world, std::move(pieces), runs_of(params, reduced));
}

RankMajorLayout post_forward_layout(const FSDPParams& params, int64_t k) {
  std::vector<int64_t> pieces;
  for (const auto& p : params) pieces.push_back(p->padded_full_numel() / k);
  return layout_of(k, std::move(pieces), std::vector<int64_t>(params.size(), 1));
}

at::Tensor init_flat_shard(const FSDPParams& params, const RankMajorLayout& layout, const GroupDevices& devices) {
  TORCH_CHECK(!params.empty(), "internal: a flat shard needs at least one parameter");
  at::NoGradGuard no_grad;  // the parameters require grad; their copies must not
  const c10::Device device = params.front()->unsharded().device();
  at::Tensor flat =
      at::empty({layout.row_numel}, at::TensorOptions().dtype(params.front()->orig_dtype()).device(device));
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    copy_piece_from_full(flat.narrow(0, layout.offset[i], layout.piece_numel[i]), p.unsharded(), layout, i,
                         p.shard_rank());
  }
  // CPU offload: the shards live in host memory, pinned when the policy says so.
  if (devices.offloaded) flat = device::ops_for(device).to_host(flat, flat.scalar_type(), devices.non_blocking, false);
  // Only this rank's real rows are visible through the leaves; the padding stays zero.
  for (size_t i = 0; i < params.size(); ++i) params[i]->init_sharded(flat, layout.offset[i]);
  return flat;
}

// ------------------------------------------------------------------------------ all-gather

at::Tensor all_gather_input(const at::Tensor& flat_shard, at::ScalarType dtype, const GroupDevices& devices) {
  if (!devices.offloaded) return flat_shard.to(dtype);  // no copy without a cast
  return device::ops_for(devices.compute).to_device(flat_shard, devices.compute, dtype, devices.non_blocking);
}

// Issues `collective` from `issue_stream` (after it waited for the current stream), or from the
// current stream when there is none (the CPU).
template <class Collective>
WorkHandle issue_on(const std::optional<c10::Stream>& issue_stream, Collective collective) {
  if (!issue_stream) return collective();
  device::DeviceOps& ops = device::ops_for(issue_stream->device_type());
  ops.wait(*issue_stream, ops.record(ops.current_stream(issue_stream->device())));
  device::StreamScope scope(*issue_stream);
  return collective();
}

AllGatherResult foreach_all_gather(const at::Tensor& input, const RankMajorLayout& layout, ProcessGroup& group,
                                   AllGather* custom, const std::optional<c10::Stream>& issue_stream) {
  TORCH_CHECK(layout.parts == group.size() && input.numel() == layout.row_numel, "internal: all-gather of ",
              input.numel(), " elements as one of ", layout.parts, " rows of ", layout.row_numel, " over a group of ",
              group.size());
  if (group.size() == 1) return AllGatherResult{nullptr, input, layout, std::nullopt, std::nullopt};
  if (!custom) {
    at::Tensor output = at::empty({layout.numel()}, input.options());
    WorkHandle work = issue_on(issue_stream, [&] { return group.all_gather_into(output, input); });
    return AllGatherResult{std::move(work), std::move(output), layout, std::nullopt, std::nullopt};
  }
  at::Tensor staged = allocate_comm_buffer(*custom, layout.row_numel, input.options(), "all-gather");
  staged.copy_(input);
  at::Tensor output = allocate_comm_buffer(*custom, layout.numel(), input.options(), "all-gather");
  WorkHandle work = issue_on(issue_stream, [&] { return (*custom)(output, staged, group); });
  return AllGatherResult{std::move(work), std::move(output), layout, std::nullopt, std::nullopt};
}

AllGatherResult foreach_all_gather_quantized(const at::Tensor& input, const RankMajorLayout& layout,
                                             ProcessGroup& group, const QuantizedComm& format,
                                             const std::optional<c10::Stream>& issue_stream) {
  TORCH_CHECK(layout.parts == group.size() && input.numel() == layout.row_numel && group.size() > 1,
              "internal: quantized all-gather of ", input.numel(), " elements as one of ", layout.parts, " rows of ",
              layout.row_numel, " over a group of ", group.size());
  const int64_t row_bytes = encoded_bytes(layout.row_numel, format);
  const auto bytes = input.options().dtype(at::kByte);
  at::Tensor encoded = at::empty({row_bytes}, bytes);
  encode(input, encoded, format);
  at::Tensor output = at::empty({layout.parts * row_bytes}, bytes);
  WorkHandle work = issue_on(issue_stream, [&] { return group.all_gather_into(output, encoded); });
  return AllGatherResult{std::move(work), std::move(output), layout, std::nullopt, std::nullopt, format};
}

namespace {

// The all-gather output as [parts, row_numel] in the unsharded dtype: a view of it, or, when it
// was quantized, every rank's row decoded into a new buffer.
at::Tensor gathered_rows(const AllGatherResult& result, at::ScalarType dtype) {
  const RankMajorLayout& layout = result.layout;
  if (!result.quantized) return result.output.view({layout.parts, layout.row_numel});
  const int64_t row_bytes = encoded_bytes(layout.row_numel, *result.quantized);
  at::Tensor rows = at::empty({layout.parts, layout.row_numel}, result.output.options().dtype(dtype));
  for (int64_t q = 0; q < layout.parts; ++q) {
    decode(result.output.narrow(0, q * row_bytes, row_bytes), rows.select(0, q), *result.quantized);
  }
  return rows;
}

}  // namespace

// FSDP2's copy-out: the pieces of every parameter leave the all-gather output in one ATen op
// (split_with_sizes_copy, one kernel on CUDA) when every parameter is sharded on dim 0, where
// each parameter's unsharded storage is [parts, piece] row-major; else in one (strided) copy per
// parameter.
void foreach_all_gather_copy_out(const AllGatherResult& result, const FSDPParams& params) {
  const RankMajorLayout& layout = result.layout;
  at::NoGradGuard no_grad;
  const at::Tensor rows = gathered_rows(result, params.front()->unsharded_dtype());
  const bool all_dim0 = std::all_of(layout.runs.begin(), layout.runs.end(), [](int64_t r) { return r == 1; });
  if (!all_dim0) {
    for (size_t i = 0; i < params.size(); ++i) {
      copy_pieces_to_unsharded(rows.narrow(1, layout.offset[i], layout.piece_numel[i]), *params[i], layout, i);
    }
    return;
  }
  std::vector<at::Tensor> outs;
  outs.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    outs.push_back(params[i]->unsharded_storage().view({layout.parts, layout.piece_numel[i]}));
  }
  at::split_with_sizes_copy_out(outs, rows, layout.piece_numel, 1);
}

// One ATen op (cat, one kernel on CUDA): piece `index` of each parameter is a slice of its
// unsharded storage (post-forward pieces are 1/k of it, runs of 1).
at::Tensor copy_post_forward_shard(const FSDPParams& params, const RankMajorLayout& layout, int64_t index) {
  TORCH_CHECK(index >= 0 && index < layout.parts, "internal: post-forward piece ", index, " of ", layout.parts);
  at::NoGradGuard no_grad;
  const c10::Device device = params.front()->unsharded().device();
  at::Tensor shard =
      at::empty({layout.row_numel}, at::TensorOptions().dtype(params.front()->unsharded_dtype()).device(device));
  std::vector<at::Tensor> pieces;
  pieces.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t piece = layout.piece_numel[i];
    pieces.push_back(params[i]->unsharded_storage().narrow(0, index * piece, piece));
  }
  at::cat_out(shard, pieces);
  return shard;
}

// ------------------------------------------------------------------------------ reduce-scatter

namespace {

at::Tensor cast_to(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// Whether ATen's _chunk_cat can lay out every gradient in one op (one kernel on CUDA): each is
// present, contiguous and non-empty, all of one dtype, all sharded on dim 0, whose chunks with
// padding are exactly the layout's pieces.
bool chunk_cat_fits(const std::vector<at::Tensor>& grads, const RankMajorLayout& layout) {
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    if (!g.defined() || !g.is_contiguous() || g.numel() == 0 || g.scalar_type() != grads.front().scalar_type() ||
        layout.runs[k] != 1) {
      return false;
    }
  }
  return !grads.empty();
}

}  // namespace

namespace {

// FSDP2's split of an fp16 division by `factor`: p doubles while it divides `factor` and
// factor / p > p, so the sum in between stays near the gradients' own magnitude.
double overflow_safe_pre_divide(double factor) {
  double p = 1.0;
  while (std::fmod(factor, p) == 0.0 && factor / p > p) p *= 2.0;
  return p;
}

}  // namespace

GradientDivision gradient_division(at::ScalarType reduce_dtype, int64_t shard_size, int64_t replicate_size,
                                   std::optional<double> divide_factor, bool force_sum_reduction) {
  TORCH_CHECK(shard_size >= 1 && replicate_size >= 1, "internal: gradient division over ", shard_size, " x ",
              replicate_size, " ranks");
  TORCH_CHECK(!divide_factor || (*divide_factor > 0 && std::isfinite(*divide_factor)),
              "internal: gradient divide "
              "factor ",
              *divide_factor);
  const bool overflow_risk = reduce_dtype != at::kFloat && reduce_dtype != at::kBFloat16;
  const int64_t data_parallel = shard_size * replicate_size;
  GradientDivision d;
  if (!overflow_risk && !force_sum_reduction) {
    if (!divide_factor) {
      if (data_parallel > 1) d.reduce_scatter_op = d.all_reduce_op = ReduceOp::kAvg;
      return d;
    }
    if (*divide_factor == static_cast<double>(shard_size)) {
      d.reduce_scatter_op = ReduceOp::kAvg;
    } else {
      d.premul = 1.0 / *divide_factor;  // PREMUL_SUM(1/F) as defined: scale each input, then SUM
    }
    return d;
  }
  const double factor = divide_factor ? *divide_factor : static_cast<double>(data_parallel);
  if (overflow_risk) {
    d.pre_divide = overflow_safe_pre_divide(factor);
    d.post_divide = factor / d.pre_divide;
  } else {
    d.post_divide = factor;  // one division of the (smaller) output instead of the input
  }
  return d;
}

// FSDP2's copy-in: one _chunk_cat of every gradient into the rank-major input, which casts them
// to the reduce dtype and pads each piece; where it does not fit (a missing gradient, a shard dim
// > 0, mixed dtypes), a few copies per parameter, as many for any number of ranks.
at::Tensor foreach_reduce_copy_in(const FSDPParams& params, const ReducedParams& reduced, const RankMajorLayout& layout,
                                  at::ScalarType reduce_dtype, CommBufferAllocator* allocator) {
  TORCH_CHECK(layout.piece_numel.size() == reduced.size(), "internal: a reduce-scatter layout of ",
              layout.piece_numel.size(), " pieces for ", reduced.size(), " reduced parameters");
  at::NoGradGuard no_grad;
  const c10::Device device = params.at(reduced.empty() ? 0 : reduced.front())->unsharded().device();
  const auto options = at::TensorOptions().dtype(reduce_dtype).device(device);
  at::Tensor input = allocator ? allocate_comm_buffer(*allocator, layout.numel(), options, "reduce-scatter")
                               : at::empty({layout.numel()}, options);
  std::vector<at::Tensor> grads;
  grads.reserve(reduced.size());
  for (size_t k : reduced) {
    FSDPParam& p = *params.at(k);
    at::Tensor g = p.unsharded_grad_to_reduce();
    TORCH_CHECK(!g.defined() || at::isFloatingType(g.scalar_type()), "FSDP reduce-scatter: the gradient of '", p.fqn(),
                "' has dtype ", g.scalar_type(), "; only floating-point gradients can be reduced");
    grads.push_back(g);
  }
  at::Tensor rows = input.view({layout.parts, layout.row_numel});
  if (chunk_cat_fits(grads, layout)) {
    at::_chunk_cat_out(rows, grads, 0, layout.parts);
  } else {
    for (size_t k = 0; k < grads.size(); ++k) {
      const at::Tensor g = grads[k].defined() ? grads[k].contiguous() : grads[k];
      copy_pieces_from_full(rows.narrow(1, layout.offset[k], layout.piece_numel[k]), g, layout, k);
    }
  }
  for (size_t k : reduced) params.at(k)->clear_unsharded_grad();
  return input;
}

// On one rank the unsharded gradient has the shard's shape already: no copy (without a cast or
// offload), no collective. A cast goes through the reduce dtype, as the reduction would. A
// reduced parameter without a gradient gets zeros, as the reduction of zeros would give it.
bool foreach_reduce_hand_over(const FSDPParams& params, const ReducedParams& reduced, const GroupDtypes& dtypes,
                              const GroupDevices& devices, bool may_run_on) {
  at::NoGradGuard no_grad;
  device::DeviceOps& ops = device::ops_for(devices.compute);
  bool in_flight = false;
  for (size_t i : reduced) {
    FSDPParam& p = *params.at(i);
    at::Tensor g = p.unsharded_grad_to_reduce();
    g = g.defined() ? cast_to(g, dtypes.reduce)
                    : at::zeros(p.sharded_shape(), at::TensorOptions().dtype(dtypes.reduce).device(devices.compute));
    if (devices.offloaded) {
      const bool non_blocking = may_run_on && devices.non_blocking && !p.sharded().grad().defined();
      p.accumulate_sharded_grad(ops.to_host(g, dtypes.orig, devices.non_blocking, non_blocking));
      in_flight = in_flight || non_blocking;
    } else {
      p.accumulate_sharded_grad(cast_to(g, dtypes.orig));
    }
    p.clear_unsharded_grad();
  }
  return in_flight;
}

ReduceScatterInput foreach_reduce_prepare(const FSDPParams& params, const ReducedParams& reduced, int64_t world,
                                          at::ScalarType reduce_dtype, ReduceScatter* custom) {
  RankMajorLayout layout = reduce_scatter_layout(params, reduced, world);
  // One rank communicates nothing, so a custom reduce-scatter is not asked for buffers either.
  at::Tensor input = foreach_reduce_copy_in(params, reduced, layout, reduce_dtype, world > 1 ? custom : nullptr);
  return ReduceScatterInput{std::move(layout), std::move(input)};
}

ReduceScatterResult foreach_reduce_issue(ReduceScatterInput prepared, const ReducedParams& reduced, ProcessGroup& group,
                                         const GradientDivision& division, ReduceScatter* custom) {
  at::Tensor& input = prepared.input;
  RankMajorLayout& layout = prepared.layout;
  if (division.pre_divide != 1.0) input.div_(division.pre_divide);
  if (division.premul != 1.0) input.mul_(division.premul);
  // One rank: its one row is the reduction of itself (SUM or AVG over one).
  if (group.size() == 1) return ReduceScatterResult{nullptr, input, input, division, reduced, std::move(layout)};
  at::Tensor output = custom ? allocate_comm_buffer(*custom, layout.row_numel, input.options(), "reduce-scatter")
                             : at::empty({layout.row_numel}, input.options());
  WorkHandle work = custom ? (*custom)(output, input, group, division.reduce_scatter_op)
                           : group.reduce_scatter_into(output, input, division.reduce_scatter_op);
  return ReduceScatterResult{std::move(work), input, std::move(output), division, reduced, std::move(layout)};
}

ReduceScatterResult foreach_reduce(const FSDPParams& params, const ReducedParams& reduced, ProcessGroup& group,
                                   at::ScalarType reduce_dtype, const GradientDivision& division,
                                   ReduceScatter* custom) {
  return foreach_reduce_issue(foreach_reduce_prepare(params, reduced, group.size(), reduce_dtype, custom), reduced,
                              group, division, custom);
}

WorkHandle foreach_all_reduce(const ReduceScatterResult& reduced, ProcessGroup& replicate_group, WorkHandle after) {
  return replicate_group.all_reduce(reduced.output, reduced.division.all_reduce_op, std::move(after));
}

namespace {

// The pieces of the reduced parameters in the group's full shard layout, as one tensor: `full`
// itself when every parameter is reduced, else a copy (write it back with scatter_reduced_pieces).
bool reduces_every_piece(const ReduceScatterResult& reduced, const RankMajorLayout& full) {
  return reduced.layout.row_numel == full.row_numel;
}

at::Tensor gather_reduced_pieces(const at::Tensor& full_row, const ReduceScatterResult& reduced,
                                 const RankMajorLayout& full) {
  if (reduces_every_piece(reduced, full)) return full_row;
  at::Tensor out = at::empty({reduced.layout.row_numel}, full_row.options());
  for (size_t k = 0; k < reduced.params.size(); ++k) {
    const size_t i = reduced.params[k];
    out.narrow(0, reduced.layout.offset[k], reduced.layout.piece_numel[k])
        .copy_(full_row.narrow(0, full.offset[i], full.piece_numel[i]));
  }
  return out;
}

void scatter_reduced_pieces(const at::Tensor& pieces, const at::Tensor& full_row, const ReduceScatterResult& reduced,
                            const RankMajorLayout& full) {
  if (reduces_every_piece(reduced, full)) return;
  for (size_t k = 0; k < reduced.params.size(); ++k) {
    const size_t i = reduced.params[k];
    full_row.narrow(0, full.offset[i], full.piece_numel[i])
        .copy_(pieces.narrow(0, reduced.layout.offset[k], reduced.layout.piece_numel[k]));
  }
}

}  // namespace

QuantizedAllReduce foreach_all_reduce_quantized(const ReduceScatterResult& reduced, ProcessGroup& replicate_group,
                                                const QuantizedComm& format, const at::Tensor& residual,
                                                const RankMajorLayout& full, ZeroBlockSkip* skip) {
  at::NoGradGuard no_grad;
  const at::Tensor pieces = residual.defined() ? gather_reduced_pieces(residual, reduced, full) : at::Tensor();
  QuantizedAllReduce q =
      issue_quantized_all_reduce(reduced.output, replicate_group, format, reduced.division.all_reduce_op, pieces, skip);
  if (pieces.defined()) scatter_reduced_pieces(pieces, residual, reduced, full);
  return q;
}

void finish_all_reduce_quantized(const QuantizedAllReduce& quantized, const ReduceScatterResult& reduced) {
  finish_quantized_all_reduce(quantized, reduced.output);
}

void foreach_reduce_copy_out(const ReduceScatterResult& result, const FSDPParams& params, at::ScalarType orig_dtype,
                             const GroupDevices& devices) {
  at::NoGradGuard no_grad;
  if (result.division.post_divide != 1.0) result.output.div_(result.division.post_divide);
  // A copy to pinned host memory may run on while the host goes on, unless a gradient there is
  // about to be added to (the host would read it before it arrived).
  bool accumulates = false;
  for (size_t i : result.params) accumulates = accumulates || params.at(i)->sharded().grad().defined();
  const at::Tensor reduced = devices.offloaded ? device::ops_for(devices.compute)
                                                     .to_host(result.output, orig_dtype, devices.non_blocking,
                                                              devices.non_blocking && !accumulates)
                                               : cast_to(result.output, orig_dtype);
  for (size_t k = 0; k < result.params.size(); ++k) {
    FSDPParam& p = *params.at(result.params[k]);
    // Shares the reduce-scatter output's storage, padding left out. Not an autograd view:
    // LibTorch's Optimizer::zero_grad() detaches grads in place, which views refuse.
    const std::vector<int64_t> shape = p.sharded_shape();
    at::Tensor grad = at::empty({0}, reduced.options());
    grad.set_(reduced.storage(), reduced.storage_offset() + result.layout.offset[k], shape,
              c10::contiguous_strides(shape));
    p.accumulate_sharded_grad(grad);
  }
}

}  // namespace detail

// The default buffers of a custom collective (fsdp/custom_comm.h): ordinary memory.
at::Tensor CommBufferAllocator::allocate(int64_t numel, at::ScalarType dtype, c10::Device device) {
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
}

}  // namespace fsdp
