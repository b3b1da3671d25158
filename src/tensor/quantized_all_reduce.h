// quantized_all_reduce.h — an all-reduce whose link carries a QuantizedComm encoding
// (fsdp/quantized_comm.h), for the callers that reduce over replicas across slow links: HSDP's
// quantized gradients (fsdp/collectives.cpp) and DiLoCo's outer step (optim/diloco.cpp).
//
// Who waits: the caller, on `work`, then calls finish_quantized_all_reduce; nothing here waits.
// bf16: an all-reduce (SUM) of the bf16 row. int8, fp8: an all-gather of every rank's encoded row,
// decoded and summed in fp32 in rank order by finish_quantized_all_reduce, so every rank gets
// bitwise the same sum (c10d has no int8 sum that cannot overflow).
//
// skip_zero_blocks (int8, fp8; QuantizedComm in fsdp/quantized_comm.h): a dense reduction's row
// starts with a 4-byte count of its nonzero blocks; a sparse one sends
//   [ k block indices: int32 ] [ the k blocks encoded as one row of k x block_size elements ]
// through an uneven all-gather, after an all-gather of every rank's k that the host waits for.
#pragma once

#include <fsdp/process_group.h>
#include <fsdp/quantized_comm.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace fsdp {
namespace detail {

// skip_zero_blocks: what one reduction site keeps across steps.
struct ZeroBlockSkip {
  // Whether the next reduction sends only nonzero blocks: decided by finish_quantized_all_reduce
  // from every rank's count, so the same on every rank.
  bool sparse_next = false;
};

struct QuantizedAllReduce {
  WorkHandle work;
  at::Tensor sent;      // this rank's encoded row (bf16: the all-reduced tensor's bytes)
  at::Tensor gathered;  // int8, fp8: every rank's encoded row, in rank order
  QuantizedComm format;
  ReduceOp op = ReduceOp::kSum;   // kSum or kAvg (the fp32 sum divided by the group's size)
  int64_t ranks = 1;              // the group's size
  ZeroBlockSkip* skip = nullptr;  // skip_zero_blocks: the site's state, updated by finish
  bool sparse = false;            // this reduction sent nonzero blocks only
  std::vector<int64_t> blocks;    // sparse: every rank's block count, in rank order
};

// Encodes `input` (1-D contiguous floating; with `residual`, as encode() in quantize.h: error
// feedback) and issues the collective over `group`. Collective; returns at once, except that a
// sparse reduction (skip_zero_blocks, `skip` required) first waits for the block counts.
QuantizedAllReduce issue_quantized_all_reduce(const at::Tensor& input, ProcessGroup& group, const QuantizedComm& format,
                                              ReduceOp op, const at::Tensor& residual = at::Tensor(),
                                              ZeroBlockSkip* skip = nullptr);
// After `reduction.work` finished: writes the reduction into `output` (1-D floating, the
// input's numel; it may be the input itself).
void finish_quantized_all_reduce(const QuantizedAllReduce& reduction, const at::Tensor& output);

}  // namespace detail
}  // namespace fsdp
