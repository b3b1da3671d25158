// quantized_all_reduce.cpp — encode, issue, and after the wait decode and sum (quantized_all_reduce.h).
#include "src/tensor/quantized_all_reduce.h"

#include "src/tensor/quantize.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace fsdp {
namespace detail {
namespace {

constexpr int64_t kCountBytes = 4;  // a dense row's count of nonzero blocks, int32

int64_t blocks_of(int64_t numel, int64_t block) { return (numel + block - 1) / block; }

// `x` as rows of `block` elements: a view when they divide its numel, else a zero-padded copy.
at::Tensor as_blocks(const at::Tensor& x, int64_t block) {
  const int64_t n = x.numel(), padded = blocks_of(n, block) * block;
  if (padded == n) return x.view({-1, block});
  at::Tensor out = at::zeros({padded}, x.options());
  out.narrow(0, 0, n).copy_(x);
  return out.view({-1, block});
}

// Whether a block of `count` elements holds a nonzero (or NaN) one, from the bits without the
// sign (so -0 is zero): the first element decides a dense gradient's block at once, and an OR
// over the rest, which compilers vectorize, a zero one.
template <typename Bits>
bool block_nonzero(const Bits* p, int64_t count, Bits magnitude) {
  if ((p[0] & magnitude) != 0) return true;
  Bits any = 0;
  for (int64_t i = 1; i < count; ++i) any |= p[i] & magnitude;
  return any != 0;
}

template <typename Bits>
at::Tensor nonzero_blocks_cpu(const Bits* p, int64_t n, int64_t block, Bits magnitude) {
  std::vector<int64_t> found;
  for (int64_t b = 0; b * block < n; ++b) {
    if (block_nonzero(p + b * block, std::min(block, n - b * block), magnitude)) found.push_back(b);
  }
  return at::tensor(found, at::kLong);
}

// The indices (int64) of the blocks of `x` that hold a nonzero (or a NaN) element.
at::Tensor nonzero_blocks(const at::Tensor& x, int64_t block) {
  if (x.numel() > 0 && x.device().is_cpu() && x.is_contiguous()) {
    if (x.scalar_type() == at::kFloat) {
      return nonzero_blocks_cpu(static_cast<const uint32_t*>(x.const_data_ptr()), x.numel(), block, 0x7fffffffu);
    }
    if (x.scalar_type() == at::kBFloat16) {
      return nonzero_blocks_cpu(static_cast<const uint16_t*>(x.const_data_ptr()), x.numel(), block,
                                static_cast<uint16_t>(0x7fff));
    }
  }
  return as_blocks(x, block).ne(0).any(1).nonzero().squeeze(1);
}

// Encodes the blocks `index` of `input` (plus their residual, which is updated in place) into
// `dst` as one row of index.numel() x block elements.
void encode_blocks(const at::Tensor& input, const at::Tensor& index, const at::Tensor& dst, const QuantizedComm& format,
                   const at::Tensor& residual) {
  const int64_t block = format.block_size();
  const at::Tensor picked = as_blocks(input, block).index_select(0, index).view(-1);
  if (!residual.defined()) {
    encode(picked, dst, format);
    return;
  }
  at::Tensor residual_blocks = as_blocks(residual, block);
  at::Tensor picked_residual = residual_blocks.index_select(0, index).view(-1);
  encode(picked, dst, format, picked_residual);
  residual_blocks.index_copy_(0, index, picked_residual.view({-1, block}));
  if (!residual_blocks.is_alias_of(residual)) residual.copy_(residual_blocks.view(-1).narrow(0, 0, residual.numel()));
}

QuantizedAllReduce issue_sparse(const at::Tensor& input, ProcessGroup& group, QuantizedAllReduce q,
                                const at::Tensor& residual) {
  const int64_t block = q.format.block_size();
  const at::Tensor index = nonzero_blocks(input, block);
  const int64_t k = index.numel();
  // Every rank's count first: the uneven all-gather needs them all.
  at::Tensor mine = at::full({1}, k, input.options().dtype(at::kLong));
  at::Tensor counts = at::empty({q.ranks}, mine.options());
  group.all_gather_into(counts, mine)->wait();
  q.blocks.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + q.ranks);
  const int64_t row_blocks = blocks_of(input.numel(), block);
  for (int64_t r = 0; r < q.ranks; ++r) {
    TORCH_CHECK(q.blocks[r] >= 0 && q.blocks[r] <= row_blocks, "quantized all-reduce (skip_zero_blocks) over ",
                group.name(), ": rank ", r, " of the group reports ", q.blocks[r], " nonzero blocks, but the row has ",
                row_blocks, "; the ranks disagree on the gradient's layout (are they running the same model?)");
  }
  std::vector<int64_t> bytes(q.ranks);
  for (int64_t r = 0; r < q.ranks; ++r) bytes[r] = 4 * q.blocks[r] + encoded_bytes(q.blocks[r] * block, q.format);
  q.sent = at::empty({bytes[group.rank()]}, input.options().dtype(at::kByte));
  q.sent.narrow(0, 0, 4 * k).view(at::kInt).copy_(index);
  if (k > 0) encode_blocks(input, index, q.sent.narrow(0, 4 * k, bytes[group.rank()] - 4 * k), q.format, residual);
  int64_t total = 0;
  for (int64_t b : bytes) total += b;
  q.gathered = at::empty({total}, q.sent.options());
  q.work = group.all_gather_v(q.gathered, q.sent, bytes);
  q.sparse = true;
  return q;
}

// Sums every rank's blocks into `sum` (fp32, numel elements) in rank order.
void finish_sparse(const QuantizedAllReduce& q, const at::Tensor& sum) {
  const int64_t block = q.format.block_size();
  at::Tensor blocks = at::zeros({blocks_of(sum.numel(), block), block}, sum.options());
  int64_t offset = 0;
  for (int64_t r = 0; r < q.ranks; ++r) {
    const int64_t k = q.blocks[r], codes = encoded_bytes(k * block, q.format);
    if (k > 0) {
      const at::Tensor index = q.gathered.narrow(0, offset, 4 * k).view(at::kInt).to(at::kLong);
      at::Tensor values = at::empty({k * block}, sum.options());
      decode(q.gathered.narrow(0, offset + 4 * k, codes), values, q.format);
      blocks.index_add_(0, index, values.view({k, block}));
    }
    offset += 4 * k + codes;
  }
  sum.copy_(blocks.view(-1).narrow(0, 0, sum.numel()));
}

// A dense row with skip_zero_blocks: its count ahead of the encoded elements.
int64_t dense_count_bytes(const QuantizedAllReduce& q) { return q.skip ? kCountBytes : 0; }

// Sparse pays 4 bytes and up to a padded block more per block sent; at most half the blocks on
// every rank keeps it well under the dense row.
bool worth_sparse(const std::vector<int64_t>& blocks, int64_t numel, int64_t block) {
  return *std::max_element(blocks.begin(), blocks.end()) * 2 <= blocks_of(numel, block);
}

}  // namespace

QuantizedAllReduce issue_quantized_all_reduce(const at::Tensor& input, ProcessGroup& group, const QuantizedComm& format,
                                              ReduceOp op, const at::Tensor& residual, ZeroBlockSkip* skip) {
  TORCH_CHECK(op == ReduceOp::kSum || op == ReduceOp::kAvg, "internal: a quantized all-reduce sums or averages, not ",
              to_string(op));
  TORCH_CHECK(!format.skip_zero_blocks() || skip, "internal: skip_zero_blocks without the reduction site's state");
  at::NoGradGuard no_grad;
  QuantizedAllReduce q;
  q.format = format;
  q.op = op;
  q.ranks = group.size();
  q.skip = format.skip_zero_blocks() ? skip : nullptr;
  if (q.skip && q.skip->sparse_next) return issue_sparse(input, group, std::move(q), residual);
  const int64_t head = dense_count_bytes(q);
  const int64_t row_bytes = head + encoded_bytes(input.numel(), format);
  q.sent = at::empty({row_bytes}, input.options().dtype(at::kByte));
  if (head > 0) {
    q.sent.narrow(0, 0, head).view(at::kInt).fill_(nonzero_blocks(input, format.block_size()).numel());
  }
  encode(input, q.sent.narrow(0, head, row_bytes - head), format, residual);
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
  std::vector<int64_t> blocks = q.blocks;
  if (q.format.dtype() == QuantizedDtype::kBFloat16) {
    decode(q.sent, sum, q.format);
  } else if (q.sparse) {
    finish_sparse(q, sum);
  } else {
    const int64_t row_bytes = q.sent.numel(), head = dense_count_bytes(q);
    for (int64_t r = 0; r < q.ranks; ++r) {
      const at::Tensor row = q.gathered.narrow(0, r * row_bytes, row_bytes);
      if (head > 0) blocks.push_back(row.narrow(0, 0, head).view(at::kInt).item<int32_t>());
      decode(row.narrow(0, head, row_bytes - head), sum, q.format, r > 0);
    }
  }
  if (q.skip) q.skip->sparse_next = worth_sparse(blocks, output.numel(), q.format.block_size());
  if (q.op == ReduceOp::kAvg) sum.div_(static_cast<double>(q.ranks));
  if (!sum.is_same(output)) output.copy_(sum);
}

}  // namespace detail
}  // namespace fsdp
