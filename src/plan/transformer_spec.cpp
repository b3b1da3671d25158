// transformer_spec.cpp — fsdp::models::Transformer as a ModelSpec: its FSDP groups as the trainer
// shards them and what each part of its forward keeps for backward.
//
// The activation bytes follow the operations of src/models/transformer.cpp one by one, with
// N = batch x seq rows, D = dim, F = 4 D, and P = batch x heads x seq x seq attention scores, in
// the compute dtype c (bytes):
//   a block keeps its LayerNorms' outputs (2 N D), the contiguous copies of q, k and v that the
//   batched matmuls make and keep (3 N D), the softmax's probabilities (P), the attention output
//   (N D), the residual h (N D), w1's output and GELU's (2 N F = 8 N D) and its own output (N D):
//   16 N D + P, plus the causal mask and the LayerNorms' statistics. Dropout with p > 0 keeps a
//   mask and its product at each site (2 P for the probabilities, 2 N D per residual).
//   Its backward peaks either in the feed-forward (5 N D above that: the incoming gradient and
//   GELU's input and output gradients) or at the softmax (2 P - 11 N D: the probabilities'
//   gradients while most of the feed-forward's activations are gone).
//   The head keeps the final norm's output (N D) and the fp32 log-softmax (4 N V); its backward
//   adds the loss's and the log-softmax's gradients (8 N V) before the output head's gradient.
// The trainer's own measurements (docs/benchmarks.md, "Planner accuracy") check these.
#include <fsdp/plan.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace fsdp {
namespace plan {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("fsdp::plan::transformer_spec: " + what);
}

GroupSpec root_group(const TransformerShape& t) {
  const int64_t V = t.vocab_size, D = t.dim, S = t.max_seq_len;
  return GroupSpec{"", {{"tok_embeddings.weight", {V, D}}, {"pos_embeddings.weight", {S, D}},
                        {"norm.weight", {D}}, {"norm.bias", {D}}, {"output.weight", {V, D}}}};
}

GroupSpec block_group(const TransformerShape& t, int64_t i) {
  const int64_t D = t.dim, F = 4 * t.dim;
  const std::string p = "layers." + std::to_string(i) + ".";
  return GroupSpec{"layers." + std::to_string(i),
                   {{p + "attention_norm.weight", {D}}, {p + "attention_norm.bias", {D}},
                    {p + "attention.wq.weight", {D, D}}, {p + "attention.wk.weight", {D, D}},
                    {p + "attention.wv.weight", {D, D}}, {p + "attention.wo.weight", {D, D}},
                    {p + "ffn_norm.weight", {D}}, {p + "ffn_norm.bias", {D}},
                    {p + "feed_forward.w1.weight", {F, D}}, {p + "feed_forward.w1.bias", {F}},
                    {p + "feed_forward.w2.weight", {D, F}}, {p + "feed_forward.w2.bias", {D}}}};
}

}  // namespace

ModelSpec transformer_spec(const TransformerShape& t, const ActivationOptions& a) {
  require(t.n_layers >= 1 && t.vocab_size >= 1 && t.dim >= 1 && t.n_heads >= 1 && t.max_seq_len >= 1,
          "every size must be >= 1");
  require(t.dim % t.n_heads == 0, "dim " + std::to_string(t.dim) + " is not divisible by n_heads " +
                                      std::to_string(t.n_heads));
  require(a.seq >= 1 && a.seq <= t.max_seq_len, "seq " + std::to_string(a.seq) + " must be in [1, max_seq_len " +
                                                    std::to_string(t.max_seq_len) + "]");
  require(a.micro_batch >= 1, "micro_batch must be >= 1");
  require(a.loss_chunks >= 1 && a.loss_chunks <= a.seq,
          "loss_chunks " + std::to_string(a.loss_chunks) + " must be in [1, seq " + std::to_string(a.seq) + "]");
  require(a.checkpoint_every >= 0, "checkpoint_every must be >= 0");
  const double c = static_cast<double>(bytes_of(a.compute));
  const double B = a.micro_batch, T = a.seq, D = t.dim, V = t.vocab_size, H = t.n_heads, L = t.n_layers;
  const double N = B * T, ND = N * D, P = B * H * T * T;
  const bool dropout = t.dropout_p > 0;
  const double stats = 2 * 2 * N * 4;  // two LayerNorms' mean and rstd

  ModelSpec m;
  m.groups.push_back(root_group(t));
  for (int64_t i = 0; i < t.n_layers; ++i) m.groups.push_back(block_group(t, i));
  // The global batch (int64, seq + 1 columns) every rank draws, and its micro-batch's inputs
  // and targets (contiguous copies).
  m.input_bytes = 8.0 * a.global_rows * (T + 1) + 2 * 8.0 * N;

  StageSpec emb;
  emb.name = "tok_embeddings";
  emb.group = 0;
  emb.grads = {0, 1};
  emb.output_bytes = c * ND;
  emb.saved_bytes = c * ND * (dropout ? 3 : 1);
  emb.forward_extra_bytes = c * (ND + T * D);
  emb.backward_extra_bytes = c * ND;
  emb.other_bytes_moved = 3 * c * ND;
  m.stages.push_back(emb);

  for (int64_t i = 0; i < t.n_layers; ++i) {
    StageSpec b;
    b.name = "layers." + std::to_string(i);
    b.group = static_cast<int>(i + 1);
    for (int k = 0; k < 12; ++k) b.grads.push_back(k);
    b.output_bytes = c * ND;
    b.saved_bytes = c * (16 * ND + P) + T * T + stats + (dropout ? c * (2 * P + 4 * ND) : 0);
    b.backward_extra_bytes = c * std::max(5 * ND, 2 * P - 11 * ND);
    b.checkpointed = a.checkpoint_every > 0 && (i + 1) % a.checkpoint_every == 0;
    // Without grad nothing is kept: the high point is the attention's scores and their masked
    // copy, or w1's and GELU's outputs.
    b.forward_extra_bytes = b.checkpointed ? c * std::max(2 * P + 2 * ND, 9 * ND) : c * std::max(0.0, P - 10 * ND);
    b.forward_flops = 2 * N * 12 * D * D + 4 * B * T * T * D;
    b.other_bytes_moved = b.saved_bytes * 2 + c * 4 * P;
    m.stages.push_back(b);
  }

  StageSpec head;
  head.name = "output";
  head.group = 0;
  head.grads = {2, 3, 4};
  head.grads_before_peak = false;  // the loss's gradients peak before the output head's exists
  head.pieces = a.loss_chunks;
  head.checkpointed = a.loss_chunks > 1;
  const double Np = B * std::ceil(T / static_cast<double>(a.loss_chunks));  // rows of the longest piece
  head.saved_bytes = c * Np * D + 4 * Np * V + 2 * Np * 4;
  head.backward_extra_bytes = 8 * Np * V;
  head.forward_extra_bytes = head.checkpointed ? c * Np * D + 8 * Np * V : 4 * Np * V;
  head.forward_flops = 2 * N * D * V;
  head.other_bytes_moved = 4 * 4 * N * V;
  m.stages.push_back(head);
  (void)L;
  return m;
}

}  // namespace plan
}  // namespace fsdp
