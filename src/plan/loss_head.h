// loss_head.h — private to src/plan: the output head and loss stage that both models' specs end
// with (transformer_spec.cpp, llama_spec.cpp). The final norm's output goes through the head
// (hidden -> vocabulary) into an fp32 cross-entropy, whole or in loss_chunks checkpointed pieces
// (chunked_linear_cross_entropy); the models differ only in what the head keeps of its input.
#pragma once

#include <fsdp/plan.h>

#include <algorithm>
#include <cmath>

namespace fsdp {
namespace plan {

// Sets head's pieces, memory and work for a head of D -> V in compute bytes c per element;
// saved_input_bytes is what the whole (unchunked) head keeps of its input for backward. The
// caller sets the name, group, gradients and output_bytes.
inline void set_loss_head(StageSpec& head, const ActivationOptions& a, double c, double D, double V,
                          double saved_input_bytes) {
  const double B = static_cast<double>(a.micro_batch), T = static_cast<double>(a.seq), N = B * T, ND = N * D;
  head.grads_before_peak = false;  // the loss's gradients peak before the output head's exists
  head.pieces = a.loss_chunks;
  head.checkpointed = a.loss_chunks > 1;
  const double Np = B * std::ceil(T / static_cast<double>(a.loss_chunks));  // rows of the longest piece
  if (head.checkpointed) {
    // chunked_linear_cross_entropy: forward keeps no piece and holds one piece's logits at a
    // time, in the compute dtype and in fp32, with log-sum-exp's temporary. Backward, per piece:
    // the fp32 gradient of the piece's logits (and its cast below fp32), x's gradient (whole,
    // written piece by piece), and the weight's gradient accumulated in fp32 from the first
    // piece (below fp32 each piece's product is made in the compute dtype, then added a block of
    // 2^20 elements at a time through an fp32 temporary of the block).
    head.saved_bytes = 0;
    head.forward_extra_bytes = 8 * Np * V + (c < 4 ? c * Np * V : 0);
    const double add_block = 4.0 * std::min(V, std::max(1.0, std::floor((1 << 20) / D))) * D;
    head.backward_extra_bytes = 4 * Np * V + c * ND + (c < 4 ? c * Np * V + c * V * D + add_block : 0);
    head.grads_accumulated_in_fp32 = true;
  } else {
    head.saved_bytes = saved_input_bytes + 4 * Np * V + 2 * Np * 4;
    head.backward_extra_bytes = 8 * Np * V;
    head.forward_extra_bytes = 4 * Np * V;
  }
  head.forward_flops = 2 * N * D * V;
  // The fp32 log-softmax, the loss and their gradients; below fp32 the logits' casts too.
  head.other_bytes_moved = 4 * 4 * N * V + (c < 4 ? 2 * (c + 4) * N * V : 0);
  head.elementwise_in_fp32 = true;
}

// A head split by vocabulary over tp (after set_loss_head): the vocab-parallel loss keeps the
// fp32 logits of the rank's slice and each row's log-sum-exp instead of a log-softmax; its
// backward makes one fp32 gradient of the logits (below fp32 its cast to the compute dtype comes
// once the kept logits are freed, which is no higher). Forward all-reduces each row's maximum (4
// bytes) and its sum of exponentials with its target's logit (8 bytes), once, outside any
// recomputation; backward all-reduces the head input's gradient (one more copy of it). N rows,
// ND = N x dim, V the rank's slice of the vocabulary, c compute bytes per element.
inline void set_vocab_parallel_loss(StageSpec& head, double c, double N, double ND, double V) {
  if (!head.checkpointed) {
    head.saved_bytes += 4 * N;
    head.backward_extra_bytes = 4 * N * V;
  }
  if (head.checkpointed) head.backward_extra_bytes += c * ND;
  head.tp_all_reduces.push_back({0, 1, c * ND, false});
  head.tp_all_reduces.push_back({1, 0, 4 * N, false});
  head.tp_all_reduces.push_back({1, 0, 8 * N, false});
}

}  // namespace plan
}  // namespace fsdp
