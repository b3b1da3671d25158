// The language models' shared part (fsdp/models/causal_lm.h): the head over the final norm's
// output, the loss with its chunked head, and activation checkpointing per decoder layer.
#include <fsdp/models/causal_lm.h>

#include <fsdp/models/linear_cross_entropy.h>

#include <fsdp/call.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>

#include <optional>
#include <set>

namespace fsdp {
namespace models {

at::Tensor CausalLM::logits(const at::Tensor& tokens) {
  torch::nn::Linear& head = output_head();
  const at::Tensor out = tp::call_linear(head, normed_hidden_states(tokens)).to(at::kFloat);
  const std::optional<tp::VocabSlice> slice = tp::vocab_slice_of(head);
  return slice ? tp::gather_from_tp_region(out, slice->group) : out;
}

at::Tensor CausalLM::forward_loss(const at::Tensor& tokens, const at::Tensor& targets, int64_t chunks) {
  TORCH_CHECK(targets.sizes() == tokens.sizes(), "forward_loss: targets have shape ", targets.sizes(), " but tokens ",
              tokens.sizes(), "; give one target per token");
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(chunks >= 1 && chunks <= seq, "forward_loss: chunks=", chunks, " must be in [1, ", seq,
              "] (at most one piece per position of the sequence)");
  const at::Tensor normed = normed_hidden_states(tokens);
  torch::nn::Linear& head = output_head();
  // A head split by vocabulary: this rank's logits are a slice of the vocabulary, and the loss
  // reads the slices where they are.
  const std::optional<tp::VocabSlice> slice = tp::vocab_slice_of(head);
  if (chunks == 1) {
    const at::Tensor logits = tp::call_linear(head, normed).to(at::kFloat);
    if (slice)
      return tp::vocab_parallel_cross_entropy(logits.reshape({-1, slice->size}), targets.reshape({-1}), *slice);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, vocab_size()}), targets.reshape({-1}));
  }
  // The output head and the loss in one autograd node (the head's weight gets one gradient),
  // run as the head's forward so that an FSDP group holding it gathers and reduces around it.
  const at::Tensor total = fsdp::call_as_forward(
      head,
      [&head, chunks, &slice](const at::Tensor& x, const at::Tensor& t) {
        if (!slice) return chunked_linear_cross_entropy(x, head->weight, t, chunks, kIgnoreIndex);
        // Each rank's piece of x's gradient comes from its slice: copy_to_tp_region sums them.
        return chunked_linear_cross_entropy(tp::copy_to_tp_region(x, slice->group), head->weight, t, chunks, *slice,
                                            kIgnoreIndex);
      },
      normed, targets);
  return total / (targets != kIgnoreIndex).sum().item<double>();
}

void CausalLM::set_activation_checkpointing(int64_t every_k, const CheckpointOptions& options) {
  TORCH_CHECK(every_k >= 0, "set_activation_checkpointing: every_k=", every_k,
              " must be >= 0 (0 turns checkpointing off, 1 checkpoints every decoder layer, k every k-th)");
  if (every_k > 0) fsdp::detail::check_checkpoint_options(options);  // now, not at the first forward
  checkpoint_every_k_ = every_k;
  checkpoint_options_ = options;
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<at::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : model.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

}  // namespace models
}  // namespace fsdp
