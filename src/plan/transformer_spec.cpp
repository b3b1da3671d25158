// transformer_spec.cpp — fsdp::models::Transformer as a ModelSpec: its FSDP groups as the trainer
// shards them and what each part of its forward keeps for backward.
//
// The activation bytes follow the operations of src/models/transformer/transformer.cpp one by one, with
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
//   Split by vocabulary over k tp ranks, V is the rank's V / k rows, the log-softmax is replaced
//   by the fp32 logits themselves, and backward makes one gradient of them.
// The trainer's own measurements (docs/benchmarks.md, "Planner accuracy") check these.
#include <fsdp/plan.h>

#include "loss_head.h"

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

// The root: the embeddings, and the final norm and head unless they are a group of their own; a
// vocab-parallel token embedding and head hold this tp rank's rows of the vocabulary.
GroupSpec root_group(const TransformerShape& t, bool with_head, int64_t vocab_split) {
  const int64_t V = t.vocab_size / vocab_split, D = t.dim, S = t.max_seq_len;
  GroupSpec g{"", {{"tok_embeddings.weight", {V, D}}, {"pos_embeddings.weight", {S, D}}}};
  if (with_head) g.params.insert(g.params.end(), {{"norm.weight", {D}}, {"norm.bias", {D}}, {"output.weight", {V, D}}});
  return g;
}

// fully_shard({norm, output}): kept gathered from its forward to its backward, which comes first.
GroupSpec head_group(const TransformerShape& t) {
  const int64_t V = t.vocab_size, D = t.dim;
  GroupSpec g{"norm+output", {{"norm.weight", {D}}, {"norm.bias", {D}}, {"output.weight", {V, D}}}};
  g.reshard_after_forward = false;
  return g;
}

// One tp rank's pieces (k = 1: the whole block): the column-parallel wq, wk, wv and w1 (with its
// bias) by rows, the row-parallel wo and w2 by columns; the norms and w2's bias whole.
GroupSpec block_group(const TransformerShape& t, int64_t i, int64_t k) {
  const int64_t D = t.dim, F = 4 * t.dim;
  const std::string p = "layers." + std::to_string(i) + ".";
  return GroupSpec{"layers." + std::to_string(i),
                   {{p + "attention_norm.weight", {D}},
                    {p + "attention_norm.bias", {D}},
                    {p + "attention.wq.weight", {D / k, D}},
                    {p + "attention.wk.weight", {D / k, D}},
                    {p + "attention.wv.weight", {D / k, D}},
                    {p + "attention.wo.weight", {D, D / k}},
                    {p + "ffn_norm.weight", {D}},
                    {p + "ffn_norm.bias", {D}},
                    {p + "feed_forward.w1.weight", {F / k, D}},
                    {p + "feed_forward.w1.bias", {F / k}},
                    {p + "feed_forward.w2.weight", {D, F / k}},
                    {p + "feed_forward.w2.bias", {D}}}};
}

void check_sizes(const TransformerShape& t, const ActivationOptions& a, const TransformerSharding& s) {
  require(t.n_layers >= 1 && t.vocab_size >= 1 && t.dim >= 1 && t.n_heads >= 1 && t.max_seq_len >= 1,
          "every size must be >= 1");
  require(t.dim % t.n_heads == 0,
          "dim " + std::to_string(t.dim) + " is not divisible by n_heads " + std::to_string(t.n_heads));
  require(a.seq >= 1 && a.seq <= t.max_seq_len,
          "seq " + std::to_string(a.seq) + " must be in [1, max_seq_len " + std::to_string(t.max_seq_len) + "]");
  require(a.micro_batch >= 1, "micro_batch must be >= 1");
  require(a.loss_chunks >= 1 && a.loss_chunks <= a.seq,
          "loss_chunks " + std::to_string(a.loss_chunks) + " must be in [1, seq " + std::to_string(a.seq) + "]");
  require(a.checkpoint_every >= 0, "checkpoint_every must be >= 0");
  const int64_t k = s.tensor_parallel;
  require(k >= 1 && t.n_heads % k == 0 && t.dim % k == 0,
          "tensor_parallel " + std::to_string(k) + " must be >= 1 and divide n_heads " + std::to_string(t.n_heads) +
              " and dim " + std::to_string(t.dim) + " (each tp rank computes whole heads)");
  require(k == 1 || !s.output_head_group,
          "output_head_group with tensor_parallel > 1: the tensor-parallel model shards its head with the root");
  require(k == 1 || !s.vocab_parallel || t.vocab_size % k == 0,
          "vocab_parallel with tensor_parallel " + std::to_string(k) + ": it does not divide vocab_size " +
              std::to_string(t.vocab_size) + " (each tp rank holds vocab_size / tp rows)");
}

// A block's activations (see the top of the file), with its attention heads and feed-forward
// split over k tp ranks: what is computed per head or per hidden feature shrinks by k, the norms'
// outputs, the residual stream and the row-parallel layers' all-reduced outputs stay whole.
StageSpec block_stage(const TransformerShape& t, const ActivationOptions& a, int64_t i, int64_t k) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double B = a.micro_batch, T = a.seq, D = t.dim, H = t.n_heads;
  const double N = B * T, ND = N * D, P = B * H * T * T / k, kd = static_cast<double>(k);
  const bool dropout = t.dropout_p > 0;
  const double stats = 2 * 2 * N * 4;  // two LayerNorms' mean and rstd
  StageSpec b;
  b.name = "layers." + std::to_string(i);
  b.group = static_cast<int>(i + 1);
  for (int p = 0; p < 12; ++p) b.grads.push_back(p);
  b.output_bytes = c * ND;
  // 2 norms, residual h, output: whole (4 N D); q, k, v copies, attention output, w1 and GELU
  // outputs: split (12 N D / k); the probabilities P / k.
  b.saved_bytes = c * ((4 + 12 / kd) * ND + P) + T * T + stats + (dropout ? c * (2 * P + 4 * ND) : 0);
  // Backward's high point: the feed-forward (incoming gradient, GELU's gradients, and under tp
  // the all-reduced input gradient), or the softmax's gradients once the feed-forward's and the
  // attention output's activations are gone.
  const double feed_forward = (1 + 4 / kd) * ND + (k > 1 ? ND : 0);
  b.backward_extra_bytes = c * std::max(feed_forward, 2 * P - (2 + 9 / kd) * ND);
  b.checkpointed = a.checkpoint_every > 0 && (i + 1) % a.checkpoint_every == 0;
  // Without grad nothing is kept: the high point is the attention's scores and their masked
  // copy, or w1's and GELU's outputs.
  b.forward_extra_bytes =
      b.checkpointed ? c * std::max(2 * P + 2 * ND, (1 + 8 / kd) * ND) : c * std::max(0.0, P - (2 + 8 / kd) * ND);
  b.forward_flops = (2 * N * 12 * D * D + 4 * B * T * T * D) / kd;
  b.other_bytes_moved = b.saved_bytes * 2 + c * 4 * P;
  // wo and w2 all-reduce their outputs; wq, wk and wv (which share their input) and w1 their
  // input's gradients.
  if (k > 1) b.tp_all_reduces.push_back({2, 2, c * ND});
  return b;
}

}  // namespace

ModelSpec transformer_spec(const TransformerShape& t, const ActivationOptions& a, const TransformerSharding& s) {
  check_sizes(t, a, s);
  const double c = static_cast<double>(bytes_of(a.compute));
  const bool split_vocab = s.tensor_parallel > 1 && s.vocab_parallel;
  const int64_t vocab_split = split_vocab ? s.tensor_parallel : 1;
  const double B = a.micro_batch, T = a.seq, D = t.dim, V = static_cast<double>(t.vocab_size / vocab_split);
  const double N = B * T, ND = N * D;
  const bool dropout = t.dropout_p > 0;

  ModelSpec m;
  m.tensor_parallel = static_cast<int>(s.tensor_parallel);
  m.groups.push_back(root_group(t, !s.output_head_group, vocab_split));
  for (int64_t i = 0; i < t.n_layers; ++i) m.groups.push_back(block_group(t, i, s.tensor_parallel));
  if (s.output_head_group) m.groups.push_back(head_group(t));
  // The global batch (int64, seq + 1 columns) every rank draws, and its micro-batch's inputs
  // and targets (contiguous copies).
  m.input_bytes = 8.0 * a.global_rows * (T + 1) + 2 * 8.0 * N;
  m.device_input_bytes = 2 * 8.0 * N;  // on a GPU: the micro-batch's inputs and targets copied there

  StageSpec emb;
  emb.name = "tok_embeddings";
  emb.group = 0;
  emb.grads = {0, 1};
  emb.output_bytes = c * ND;
  emb.saved_bytes = c * ND * (dropout ? 3 : 1);
  emb.forward_extra_bytes = c * (ND + T * D);
  emb.backward_extra_bytes = c * ND;
  emb.other_bytes_moved = 3 * c * ND;
  if (split_vocab) {
    // Each rank looks up the tokens in its rows, zeroes the others' (a copy, and its mask kept
    // for backward, which zeroes the gradient the same way) and all-reduces the sum.
    emb.saved_bytes += N;
    emb.backward_extra_bytes += c * ND;
    emb.tp_all_reduces.push_back({1, 0, c * ND});
  }
  m.stages.push_back(emb);

  for (int64_t i = 0; i < t.n_layers; ++i) m.stages.push_back(block_stage(t, a, i, s.tensor_parallel));

  StageSpec head;
  head.name = "output";
  head.group = s.output_head_group ? static_cast<int>(m.groups.size()) - 1 : 0;
  head.grads = s.output_head_group ? std::vector<int>{0, 1, 2} : std::vector<int>{2, 3, 4};
  set_loss_head(head, a, c, D, V, /*saved_input_bytes=*/c * B * std::ceil(T / static_cast<double>(a.loss_chunks)) * D);
  if (split_vocab) set_vocab_parallel_loss(head, c, N, ND, V);
  // In pieces, forward keeps the final norm's whole output, its statistics and each row's
  // log-sum-exp (chunked_linear_cross_entropy), and recomputes the logits piece by piece.
  head.output_bytes = head.checkpointed ? c * ND + 4 * N + 2 * N * 4 : 0;
  m.stages.push_back(head);
  return m;
}

}  // namespace plan
}  // namespace fsdp
