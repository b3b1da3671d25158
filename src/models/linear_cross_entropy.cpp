// The chunked output head + cross-entropy of fsdp/models/linear_cross_entropy.h.
#include <fsdp/models/linear_cross_entropy.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace fsdp {
namespace models {
namespace {

// [start, length) of each of `chunks` pieces of `rows`: rows / chunks each, the first
// rows % chunks one longer.
std::vector<std::pair<int64_t, int64_t>> row_pieces(int64_t rows, int64_t chunks) {
  std::vector<std::pair<int64_t, int64_t>> pieces;
  const int64_t base = rows / chunks, longer = rows % chunks;
  for (int64_t c = 0, start = 0; c < chunks; ++c) {
    const int64_t length = base + (c < longer ? 1 : 0);
    pieces.emplace_back(start, length);
    start += length;
  }
  return pieces;
}

// Elements of the weight's gradient added to the fp32 sum at a time below fp32 (whole rows, at
// least one): add_ promotes the product to fp32 in a temporary, which stays about this size
// (4 MiB) instead of the whole [vocab, dim].
constexpr int64_t kAddElements = int64_t{1} << 20;

// sum += product (product in a lower dtype), a block of rows at a time.
void add_in_row_blocks(at::Tensor& sum, const at::Tensor& product) {
  const int64_t rows = product.size(0);
  const int64_t block = std::max<int64_t>(1, kAddElements / std::max<int64_t>(1, product.size(1)));
  for (int64_t start = 0; start < rows; start += block) {
    const int64_t n = std::min(block, rows - start);
    sum.narrow(0, start, n).add_(product.narrow(0, start, n));
  }
}

// One piece's fp32 logits, computed as linear() computes them, in the inputs' dtype.
at::Tensor piece_logits(const at::Tensor& x_piece, const at::Tensor& weight) {
  return at::linear(x_piece, weight).to(at::kFloat);
}

struct ChunkedLinearCrossEntropy : public torch::autograd::Function<ChunkedLinearCrossEntropy> {
  // x: [rows, dim], targets: [rows]; weight holds the vocabulary's rows [first, first + its rows)
  // and `group` the other rows (null: weight is the whole head). Runs under no-grad (autograd's
  // custom functions do).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& targets, int64_t chunks, int64_t ignore_index, int64_t first,
                            const std::shared_ptr<ProcessGroup>& group) {
    const int64_t rows = x.size(0);
    at::Tensor logsumexp = at::empty({rows}, x.options().dtype(at::kFloat));
    at::Tensor target_logit = at::empty({rows}, x.options().dtype(at::kFloat));
    for (const auto& [start, length] : row_pieces(rows, chunks)) {
      const at::Tensor logits = piece_logits(x.narrow(0, start, length), weight);
      const tp::TargetColumns t = tp::target_columns(targets.narrow(0, start, length), first, weight.size(0));
      logsumexp.narrow(0, start, length).copy_(at::logsumexp(logits, {1}));
      target_logit.narrow(0, start, length)
          .copy_(logits.gather(1, t.column.unsqueeze(1)).squeeze(1).masked_fill_(t.here.logical_not(), 0.0));
    }
    if (group) tp::combine_vocab_parallel_rows(logsumexp, target_logit, *group);
    const at::Tensor counted = targets != ignore_index;
    ctx->save_for_backward({x, weight, targets, logsumexp});
    ctx->saved_data["chunks"] = chunks;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["first"] = first;
    return (logsumexp - target_logit).masked_fill_(counted.logical_not(), 0.0).sum();
  }

  // d loss / d logits of a row = softmax(logits) - onehot(target), times the incoming gradient;
  // zero for an ignored row. From it, per piece: d x = g W, d W += g^T x.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &targets = saved[2], &logsumexp = saved[3];
    const int64_t chunks = ctx->saved_data["chunks"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t first = ctx->saved_data["first"].toInt();
    const at::Tensor grad_total = grad_outputs[0].to(at::kFloat);
    const bool want_x = ctx->needs_input_grad(0), want_weight = ctx->needs_input_grad(1);
    at::Tensor grad_x = want_x ? at::empty_like(x) : at::Tensor();
    at::Tensor grad_weight;  // fp32, accumulated over the pieces
    for (const auto& [start, length] : row_pieces(x.size(0), chunks)) {
      const at::Tensor x_piece = x.narrow(0, start, length);
      const at::Tensor t = targets.narrow(0, start, length);
      const at::Tensor counted = t != ignore_index;
      const tp::TargetColumns here = tp::target_columns(t, first, weight.size(0));
      // In place on the recomputed logits: softmax, minus one at the target (where this weight
      // holds it), times the incoming gradient (zero for ignored rows), so the piece holds one
      // [length, vocab] buffer.
      at::Tensor g = piece_logits(x_piece, weight);
      g.sub_(logsumexp.narrow(0, start, length).unsqueeze(1)).exp_();
      g.scatter_add_(1, here.column.unsqueeze(1), here.here.to(at::kFloat).neg_().unsqueeze(1));
      g.mul_((counted.to(at::kFloat) * grad_total).unsqueeze(1));
      const at::Tensor g_in = g.to(x.scalar_type());
      if (want_x) {
        at::Tensor grad_x_piece = grad_x.narrow(0, start, length);  // contiguous rows: written in place
        at::mm_out(grad_x_piece, g_in, weight);
      }
      if (want_weight) {
        if (!grad_weight.defined()) {
          grad_weight = at::mm(g_in.t(), x_piece).to(at::kFloat);
        } else if (x.scalar_type() == at::kFloat) {
          grad_weight.addmm_(g_in.t(), x_piece);  // no [vocab, dim] temporary per piece
        } else {
          add_in_row_blocks(grad_weight, at::mm(g_in.t(), x_piece));  // the piece in x's dtype, summed in fp32
        }
      }
    }
    if (grad_weight.defined()) grad_weight = grad_weight.to(weight.scalar_type());
    return {grad_x, grad_weight, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The checks of both forms, and the call: weight holds the rows [first, first + rows) of the
// vocabulary, `group` the others (null: all of them).
at::Tensor linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                int64_t chunks, int64_t ignore_index, int64_t first,
                                const std::shared_ptr<ProcessGroup>& group) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2 && x.size(-1) == weight.size(1),
              "chunked_linear_cross_entropy: x has shape ", x.sizes(), " and weight ", weight.sizes(),
              "; give x [..., dim] and weight [vocab, dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && at::isFloatingType(x.scalar_type()),
              "chunked_linear_cross_entropy: x is ", x.scalar_type(), " and weight ", weight.scalar_type(),
              "; give both the same floating dtype (the dtype the head computes in)");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.sizes() == x.sizes().slice(0, x.dim() - 1),
              "chunked_linear_cross_entropy: targets are ", targets.scalar_type(), " of shape ", targets.sizes(),
              "; give int64 class indices of x's leading shape ", x.sizes().slice(0, x.dim() - 1));
  const at::Tensor rows_x = x.reshape({-1, x.size(-1)});
  const int64_t rows = rows_x.size(0);
  TORCH_CHECK(chunks >= 1 && chunks <= rows, "chunked_linear_cross_entropy: chunks=", chunks, " must be in [1, ", rows,
              "] (at most one piece per row)");
  // A target outside the vocabulary would otherwise count as a logit of 0 (no rank holds it).
  const int64_t vocab = group ? weight.size(0) * group->size() : weight.size(0);
  const at::Tensor outside = (targets < 0).logical_or_(targets >= vocab).logical_and_(targets != ignore_index);
  TORCH_CHECK(!outside.any().item<bool>(), "chunked_linear_cross_entropy: a target is outside the vocabulary [0, ",
              vocab, ") and is not ignore_index=", ignore_index, "; give class indices the head has");
  return ChunkedLinearCrossEntropy::apply(rows_x, weight, targets.reshape({-1}), chunks, ignore_index, first, group);
}

}  // namespace

at::Tensor chunked_linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                        int64_t chunks, int64_t ignore_index) {
  return linear_cross_entropy(x, weight, targets, chunks, ignore_index, 0, nullptr);
}

at::Tensor chunked_linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                        int64_t chunks, const tp::VocabSlice& slice, int64_t ignore_index) {
  TORCH_CHECK(slice.group != nullptr && weight.dim() == 2 && weight.size(0) == slice.size,
              "chunked_linear_cross_entropy: weight has shape ", weight.sizes(), " for a vocabulary slice of ",
              slice.size, " rows", slice.group ? "" : " and no process group",
              "; give this rank's rows of the head and the tp group holding the others (tp::vocab_slice_of)");
  return linear_cross_entropy(x, weight, targets, chunks, ignore_index, slice.start, slice.group);
}

}  // namespace models
}  // namespace fsdp
