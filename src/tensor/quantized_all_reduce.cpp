// quantized_all_reduce.cpp — encode, issue, and after the wait decode and sum (quantized_all_reduce.h).
#include "src/tensor/quantized_all_reduce.h"

#include "src/tensor/quantize.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace detail {

QuantizedAllReduce issue_quantized_all_reduce(const at::Tensor& input, ProcessGroup& group, const QuantizedComm& format,
                                              ReduceOp op, const at::Tensor& residual) {
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "internal: a quantized all-reduce sums or averages, not ",
              to_string(op));
  at::NoGradGuard no_grad;
  QuantizedAllReduce q;
  q.format = format;
  q.op = op;
  q.ranks = group.size();
  const int64_t row_bytes = encoded_bytes(input.numel(), format);
  q.sent = at::empty({row_bytes}, input.options().dtype(at::kByte));
  encode(input, q.sent, format, residual);
  if (format.dtype() == QuantizedDtype::kBFloat16) {
    // A SUM: an average is divided in fp32 afterwards.
    q.work = group.all_reduce(q.sent.narrow(0, 0, 2 * input.numel()).view(at::kBFloat16), ReduceOp::kSum);
  } else {
    q.gathered = at::empty({q.ranks * row_bytes}, q.sent.options());
    q.work = group.all_gather_into(q.gathered, q.sent);
  }
  return q;
}

void finish_quantized_all_reduce(const QuantizedAllReduce& q, const at::Tensor& output) {
  at::NoGradGuard no_grad;
  at::Tensor sum =
      output.scalar_type() == at::kFloat ? output : at::empty({output.numel()}, output.options().dtype(at::kFloat));
  if (q.format.dtype() == QuantizedDtype::kBFloat16) {
    decode(q.sent, sum, q.format);
  } else {
    const int64_t row_bytes = q.sent.numel();
    for (int64_t r = 0; r < q.ranks; ++r) decode(q.gathered.narrow(0, r * row_bytes, row_bytes), sum, q.format, r > 0);
  }
  if (q.op == ReduceOp::kAvg) sum.div_(static_cast<double>(q.ranks));
  if (!sum.is_same(output)) output.copy_(sum);
}

}  // namespace detail
}  // namespace fsdp
