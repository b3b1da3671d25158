// The cross-entropy of logits split by vocabulary over tp (Megatron's vocab-parallel
// cross-entropy): each rank reduces its own columns to a few numbers per row, and only those
// cross the tp group; the [rows, vocab] logits are never gathered.
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

namespace fsdp {
namespace tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  // logits: [rows, size] of this rank's slice. Returns the fp32 sum of the counted rows' losses.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            const VocabSlice& slice, int64_t ignore_index) {
    const at::Tensor fp32 = logits.to(at::kFloat);
    at::Tensor logsumexp = at::logsumexp(fp32, {1});
    const TargetColumns t = target_columns(targets, slice.start, slice.size);
    at::Tensor target_logit = fp32.gather(1, t.column.unsqueeze(1)).squeeze(1).masked_fill_(t.here.logical_not(), 0.0);
    combine_vocab_parallel_rows(logsumexp, target_logit, *slice.group);
    const at::Tensor counted = targets != ignore_index;
    ctx->save_for_backward({logits, targets, logsumexp});
    ctx->saved_data["start"] = slice.start;
    ctx->saved_data["ignore_index"] = ignore_index;
    return (logsumexp - target_logit).masked_fill_(counted.logical_not(), 0.0).sum();
  }

  // d loss / d logits of a row = softmax(whole row) - onehot(target), on this rank's columns.
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &logits = saved[0], &targets = saved[1], &logsumexp = saved[2];
    const TargetColumns t = target_columns(targets, ctx->saved_data["start"].toInt(), logits.size(1));
    const at::Tensor counted = targets != ctx->saved_data["ignore_index"].toInt();
    at::Tensor g = logits.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    g.sub_(logsumexp.unsqueeze(1)).exp_();
    g.scatter_add_(1, t.column.unsqueeze(1), t.here.to(at::kFloat).neg_().unsqueeze(1));
    g.mul_((counted.to(at::kFloat) * grad_outputs[0].to(at::kFloat)).unsqueeze(1));
    return {g.to(logits.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

TargetColumns target_columns(const at::Tensor& targets, int64_t first, int64_t size) {
  const at::Tensor here = (targets >= first).logical_and_(targets < first + size);
  return {here, (targets - first).masked_fill_(here.logical_not(), 0)};
}

void combine_vocab_parallel_rows(at::Tensor& logsumexp, at::Tensor& target_logit, ProcessGroup& group) {
  TORCH_CHECK(logsumexp.scalar_type() == at::kFloat && target_logit.scalar_type() == at::kFloat &&
                  logsumexp.dim() == 1 && target_logit.sizes() == logsumexp.sizes(),
              "fsdp::tp::combine_vocab_parallel_rows: give fp32 [rows] tensors of the same size, got ",
              logsumexp.scalar_type(), " ", logsumexp.sizes(), " and ", target_logit.scalar_type(), " ",
              target_logit.sizes());
  if (group.size() == 1) return;
  at::Tensor highest = logsumexp.contiguous().clone();
  group.all_reduce(highest, ReduceOp::kMax)->wait();
  // Each exp is at most 1: no overflow whatever the logits' range.
  at::Tensor sums = at::stack({(logsumexp - highest).exp_(), target_logit});
  group.all_reduce(sums, ReduceOp::kSum)->wait();
  logsumexp.copy_(highest.add_(sums[0].log()));
  target_logit.copy_(sums[1]);
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const VocabSlice& slice, int64_t ignore_index) {
  TORCH_CHECK(slice.group != nullptr, "fsdp::tp::vocab_parallel_cross_entropy: the slice's process group is null");
  TORCH_CHECK(
      local_logits.dim() == 2 && at::isFloatingType(local_logits.scalar_type()) && local_logits.size(1) == slice.size,
      "fsdp::tp::vocab_parallel_cross_entropy: local_logits are ", local_logits.scalar_type(), " of shape ",
      local_logits.sizes(), "; give floating [rows, ", slice.size, "] (this rank's slice of the vocabulary)");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == local_logits.size(0),
              "fsdp::tp::vocab_parallel_cross_entropy: targets are ", targets.scalar_type(), " of shape ",
              targets.sizes(), "; give int64 [", local_logits.size(0), "] (one class index per row)");
  // A target outside the vocabulary would otherwise count as a logit of 0 (no rank holds it).
  const int64_t vocab = slice.size * slice.group->size();
  const at::Tensor outside = (targets < 0).logical_or_(targets >= vocab).logical_and_(targets != ignore_index);
  TORCH_CHECK(!outside.any().item<bool>(),
              "fsdp::tp::vocab_parallel_cross_entropy: a target is outside the "
              "vocabulary [0, ",
              vocab, ") and is not ignore_index=", ignore_index, "; give class indices the head has");
  const at::Tensor total = VocabParallelCrossEntropy::apply(local_logits, targets, slice, ignore_index);
  return total / (targets != ignore_index).sum().to(at::kFloat);
}

}  // namespace tp
}  // namespace fsdp
