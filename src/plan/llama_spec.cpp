// llama_spec.cpp — fsdp::models::Llama as a ModelSpec: its FSDP groups as the trainer shards them
// and what each part of its forward keeps for backward.
//
// The activation bytes follow the operations of src/models/llama/llama.cpp, with N = batch x seq rows,
// D = hidden_size, Q = n_heads x head_dim, K = n_kv_heads x head_dim, I = intermediate_size, in
// the compute dtype c (bytes):
//   an RMSNorm keeps its normalised input and its output (2 N D), its reciprocal root (fp32, N),
//   and below fp32 the fp32 copy of its input (4 N D);
//   attention keeps the rotated queries (N Q), the keys and values the scaled-dot-product
//   attention reads (N Q each once repeated for grouped-query attention, N K without), its output
//   (N Q, which o_proj reads too: the CPU kernel writes it heads-last, so the transpose's
//   contiguous copy is the same tensor) and its log-sum-exp (fp32, per row and head);
//   the residual h (N D); SwiGLU's gate, up, SiLU and their product (4 N I); the output (N D).
//   Backward peaks in SwiGLU (the incoming gradient and two N I gradients: the product's
//   gradient is made as down_proj releases the product, and the gradients of gate's SiLU and of
//   up are made as the product's is freed) or in attention (the gradients of the queries, keys
//   and values and the output's).
//   The head keeps the final norm's tensors as above and the fp32 log-softmax (4 N V), as the
//   Transformer's does; its backward adds the loss's and the log-softmax's gradients (8 N V).
// A tied embedding is one parameter of the root, listed once; its gradient is made by the head's
// backward (which comes first) and the embedding's adds into it.
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
  if (!ok) throw std::invalid_argument("fsdp::plan::llama_spec: " + what);
}

void check_sizes(const LlamaShape& l, const ActivationOptions& a, const TransformerSharding& s) {
  require(l.n_layers >= 1 && l.vocab_size >= 1 && l.hidden_size >= 1 && l.intermediate_size >= 1 && l.n_heads >= 1 &&
              l.n_kv_heads >= 1 && l.head_dim >= 1 && l.max_position_embeddings >= 1,
          "every size must be >= 1");
  require(l.n_heads % l.n_kv_heads == 0,
          "n_heads " + std::to_string(l.n_heads) + " is not a multiple of n_kv_heads " + std::to_string(l.n_kv_heads));
  require(l.head_dim % 2 == 0, "head_dim " + std::to_string(l.head_dim) + " must be even (rotary pairs)");
  require(a.seq >= 1 && a.seq <= l.max_position_embeddings, "seq " + std::to_string(a.seq) +
                                                                " must be in [1, max_position_embeddings " +
                                                                std::to_string(l.max_position_embeddings) + "]");
  require(a.micro_batch >= 1, "micro_batch must be >= 1");
  require(a.loss_chunks >= 1 && a.loss_chunks <= a.seq,
          "loss_chunks " + std::to_string(a.loss_chunks) + " must be in [1, seq " + std::to_string(a.seq) + "]");
  require(a.checkpoint_every >= 0, "checkpoint_every must be >= 0");
  const int64_t k = s.tensor_parallel;
  require(k >= 1 && l.n_kv_heads % k == 0 && l.intermediate_size % k == 0,
          "tensor_parallel " + std::to_string(k) + " must divide n_kv_heads " + std::to_string(l.n_kv_heads) +
              " and intermediate_size " + std::to_string(l.intermediate_size));
  require(
      k == 1 || !s.vocab_parallel || (l.vocab_size % k == 0 && !l.tie_word_embeddings),
      "vocab_parallel with tensor_parallel " + std::to_string(k) + " needs a vocab_size it divides and an untied head");
  require(k == 1 || !s.output_head_group, "output_head_group with tensor_parallel > 1: the head is the root's");
  require(!s.output_head_group || !l.tie_word_embeddings,
          "output_head_group with tie_word_embeddings: the head's weight is the embedding's, which the root holds");
}

// The root: the embedding, and the final norm and the head unless they are a group of their own
// (or the head is the embedding's weight); split by vocabulary, this tp rank's rows.
GroupSpec root_group(const LlamaShape& l, bool with_head, int64_t vocab_split) {
  const int64_t V = l.vocab_size / vocab_split, D = l.hidden_size;
  GroupSpec g{"", {{"model.embed_tokens.weight", {V, D}}}};
  if (!with_head) return g;
  g.params.push_back({"model.norm.weight", {D}});
  if (!l.tie_word_embeddings) g.params.push_back({"lm_head.weight", {V, D}});
  return g;
}

// fully_shard({model.norm, lm_head}): kept gathered from its forward to its backward, which comes first.
GroupSpec head_group(const LlamaShape& l) {
  const int64_t V = l.vocab_size, D = l.hidden_size;
  GroupSpec g{"model.norm+lm_head", {{"model.norm.weight", {D}}, {"lm_head.weight", {V, D}}}};
  g.reshard_after_forward = false;
  return g;
}

// One tp rank's pieces (k = 1: the whole layer): q, k, v, gate and up column-parallel by rows
// (with the q/k/v biases), o and down row-parallel by columns, the norms whole.
GroupSpec layer_group(const LlamaShape& l, int64_t i, int64_t k) {
  const int64_t D = l.hidden_size, Q = l.n_heads * l.head_dim / k, K = l.n_kv_heads * l.head_dim / k,
                I = l.intermediate_size / k;
  const std::string p = "model.layers." + std::to_string(i) + ".";
  GroupSpec g{"model.layers." + std::to_string(i),
              {{p + "input_layernorm.weight", {D}},
               {p + "self_attn.q_proj.weight", {Q, D}},
               {p + "self_attn.k_proj.weight", {K, D}},
               {p + "self_attn.v_proj.weight", {K, D}},
               {p + "self_attn.o_proj.weight", {D, Q}},
               {p + "post_attention_layernorm.weight", {D}},
               {p + "mlp.gate_proj.weight", {I, D}},
               {p + "mlp.up_proj.weight", {I, D}},
               {p + "mlp.down_proj.weight", {D, I}}}};
  if (l.attention_bias)
    g.params.insert(
        g.params.end(),
        {{p + "self_attn.q_proj.bias", {Q}}, {p + "self_attn.k_proj.bias", {K}}, {p + "self_attn.v_proj.bias", {K}}});
  return g;
}

// What one RMSNorm keeps beyond its input: the normalised input, the output, the reciprocal root,
// and below fp32 its input's fp32 copy.
double rms_norm_bytes(double c, double N, double D) { return (c < 4 ? 4 * N * D : 0) + 2 * c * N * D + 4 * N; }

// A layer's activations (see the top of the file), its heads and SwiGLU's features split over k
// tp ranks: what is computed per head or per feature shrinks by k; the norms, the residual and the
// row-parallel layers' all-reduced outputs stay whole.
StageSpec layer_stage(const LlamaShape& l, const ActivationOptions& a, int64_t i, int64_t n_params, int64_t k) {
  const double c = static_cast<double>(bytes_of(a.compute)), kd = static_cast<double>(k);
  const double B = a.micro_batch, T = a.seq, D = l.hidden_size, I = l.intermediate_size / kd;
  const double Q = static_cast<double>(l.n_heads * l.head_dim) / kd,
               K = static_cast<double>(l.n_kv_heads * l.head_dim) / kd;
  const double N = B * T, ND = N * D, kv = l.n_heads > l.n_kv_heads ? Q : K;
  StageSpec s;
  s.name = "model.layers." + std::to_string(i);
  s.group = static_cast<int>(i + 1);
  for (int p = 0; p < n_params; ++p) s.grads.push_back(p);
  s.output_bytes = c * ND;
  const double attention = c * N * (2 * Q + 2 * kv) + 4.0 * B * (static_cast<double>(l.n_heads) / kd) * T;
  s.saved_bytes = 2 * rms_norm_bytes(c, N, D) + attention + c * (2 * ND + 4 * N * I);
  // Under tp the all-reduced gradient of a column-parallel layer's input is one more copy.
  const double all_reduced = k > 1 ? ND : 0;
  s.backward_extra_bytes = c * (std::max(ND + 2 * N * I, ND + 2 * N * Q + 2 * N * kv) + all_reduced);
  s.checkpointed = a.checkpoint_every > 0 && (i + 1) % a.checkpoint_every == 0;
  // The rotary embedding's temporaries; without grad, SwiGLU's or attention's working set.
  s.forward_extra_bytes = s.checkpointed ? c * std::max(ND + 3 * N * I, ND + 3 * N * Q + 2 * N * kv) : c * 2 * N * Q;
  s.forward_flops = 2 * N * (2 * D * Q + 2 * D * K + 3 * D * I) + 4 * B * T * T * Q;
  s.other_bytes_moved = s.saved_bytes * 2;
  // o_proj and down_proj all-reduce their outputs; q/k/v (which share their input) and gate/up
  // their input's gradients.
  if (k > 1) s.tp_all_reduces.push_back({2, 2, c * ND});
  return s;
}

StageSpec embedding_stage(const LlamaShape& l, const ActivationOptions& a, bool split_vocab) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double N = static_cast<double>(a.micro_batch) * a.seq, ND = N * l.hidden_size;
  StageSpec emb;
  emb.name = "model.embed_tokens";
  emb.group = 0;
  if (!l.tie_word_embeddings) emb.grads = {0};  // tied: the head's backward made it
  emb.output_bytes = emb.saved_bytes = c * ND;
  emb.forward_extra_bytes = emb.backward_extra_bytes = c * ND;
  emb.other_bytes_moved = 3 * c * ND;
  if (split_vocab) {
    // As the Transformer's: the rank's rows looked up, the others' zeroed (the mask kept), the sum all-reduced.
    emb.saved_bytes += N;
    emb.backward_extra_bytes += c * ND;
    emb.tp_all_reduces.push_back({1, 0, c * ND});
  }
  return emb;
}

// The final norm, the head and the loss (loss_head.h); what the whole head keeps of its input is
// the RMSNorm's. Split by vocabulary, as the Transformer's (transformer_spec.cpp).
StageSpec head_stage(const LlamaShape& l, const ActivationOptions& a, const TransformerSharding& s, int group,
                     int64_t vocab_split) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double N = static_cast<double>(a.micro_batch) * a.seq, D = l.hidden_size, ND = N * D;
  const double V = static_cast<double>(l.vocab_size / vocab_split);
  const double norm = rms_norm_bytes(c, N, D);
  StageSpec head;
  head.name = "lm_head";
  head.group = group;
  if (s.output_head_group) head.grads = {0, 1};
  else head.grads = l.tie_word_embeddings ? std::vector<int>{0, 1} : std::vector<int>{1, 2};
  set_loss_head(head, a, c, D, V, /*saved_input_bytes=*/norm);
  if (vocab_split > 1) set_vocab_parallel_loss(head, c, N, ND, V);
  if (head.checkpointed) head.output_bytes = norm + 4 * N;
  return head;
}

}  // namespace

ModelSpec llama_spec(const LlamaShape& l, const ActivationOptions& a, const TransformerSharding& s) {
  check_sizes(l, a, s);
  const int64_t k = s.tensor_parallel;
  const int64_t vocab_split = k > 1 && s.vocab_parallel ? k : 1;
  ModelSpec m;
  m.tensor_parallel = static_cast<int>(k);
  m.groups.push_back(root_group(l, !s.output_head_group, vocab_split));
  for (int64_t i = 0; i < l.n_layers; ++i) m.groups.push_back(layer_group(l, i, k));
  if (s.output_head_group) m.groups.push_back(head_group(l));
  const double N = static_cast<double>(a.micro_batch) * a.seq;
  m.input_bytes = 8.0 * a.global_rows * (a.seq + 1) + 2 * 8.0 * N;
  m.device_input_bytes = 2 * 8.0 * N;
  m.stages.push_back(embedding_stage(l, a, vocab_split > 1));
  for (int64_t i = 0; i < l.n_layers; ++i)
    m.stages.push_back(
        layer_stage(l, a, i, static_cast<int64_t>(m.groups[static_cast<size_t>(i + 1)].params.size()), k));
  m.stages.push_back(head_stage(l, a, s, s.output_head_group ? static_cast<int>(m.groups.size()) - 1 : 0, vocab_split));
  return m;
}

}  // namespace plan
}  // namespace fsdp
