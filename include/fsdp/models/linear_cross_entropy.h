// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/linear_cross_entropy.h — an output head and its cross-entropy in one autograd
/// function that never holds the whole logits.
///
/// \code{.cpp}
///   at::Tensor loss_sum = fsdp::models::chunked_linear_cross_entropy(x, head->weight, targets, 8);
/// \endcode
///
/// is cross_entropy(linear(x, weight).to(kFloat), targets, reduction sum) up to float rounding,
/// computed over the rows of x in `chunks` pieces. Forward computes each piece's logits, its fp32
/// log-sum-exp and the target's logit, and keeps only the log-sum-exp of each row (4 bytes a
/// row); backward computes each piece's logits again and from them the gradients of x and of
/// the weight, a piece at a time. So the [rows, vocab] logits, their softmax and their gradient
/// exist one piece at a time, and the weight is used by one autograd node that gives it exactly
/// one gradient per call: an FSDP group holding the head is gathered once and reduce-scatters
/// once (a checkpoint per piece would recompute, and reduce, once per piece). The cost is one more
/// matmul of the head per piece in backward.
#pragma once

#include <fsdp/tensor_parallel.h>

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace fsdp {
namespace models {

/// x: [..., dim] floating (any leading shape; its rows are flattened); weight: [vocab, dim], the
/// same dtype as x (the matmul runs in it, as linear() would; the softmax and the loss in fp32);
/// targets: int64 of x's leading shape, class indices in [0, vocab) or ignore_index (a row that
/// adds nothing to the loss and gets a zero gradient). Returns the fp32 sum of the rows' losses,
/// a 0-dim tensor (divide by the number of counted rows for the mean). The pieces are rows / chunks
/// rows each, the first rows % chunks one longer. The weight's gradient is accumulated in fp32
/// over the pieces and returned in the weight's dtype. Not twice differentiable. Throws c10::Error
/// unless 1 <= chunks <= rows, or for mismatched shapes or dtypes.
at::Tensor chunked_linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                        int64_t chunks, int64_t ignore_index = -100);
/// The same for an output head split by vocabulary over tensor parallelism (a vocab-parallel head,
/// fsdp/tensor_parallel.h): weight is this rank's rows [slice.start, slice.start + slice.size) of
/// the whole head, targets index the whole vocabulary, and the result is the whole vocabulary's
/// loss sum, the same on every rank of slice.group. Each rank computes only its slice's logits;
/// after the pieces, two all-reduces of a few bytes a row combine the ranks' log-sum-exps and
/// target logits (tp::combine_vocab_parallel_rows); backward communicates nothing. x's gradient
/// is this rank's part (from its slice of the logits): pass x through tp::copy_to_tp_region first,
/// which sums the parts over tp in backward. Collective over slice.group, in forward.
at::Tensor chunked_linear_cross_entropy(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& targets,
                                        int64_t chunks, const tp::VocabSlice& slice, int64_t ignore_index = -100);

}  // namespace models
}  // namespace fsdp
