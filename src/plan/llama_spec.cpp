// llama_spec.cpp — fsdp::models::Llama as a ModelSpec: its FSDP groups as the trainer shards them
// and what each part of its forward keeps for backward.
//
// The activation bytes follow the operations of src/models/llama.cpp, with N = batch x seq rows,
// D = hidden_size, Q = n_heads x head_dim, K = n_kv_heads x head_dim, I = intermediate_size, in
// the compute dtype c (bytes):
//   an RMSNorm keeps its normalised input and its output (2 N D), its reciprocal root (fp32, N),
//   and below fp32 the fp32 copy of its input (4 N D);
//   attention keeps the rotated queries (N Q), the keys and values the scaled-dot-product
//   attention reads (N Q each once repeated for grouped-query attention, N K without), its output
//   (N Q, which o_proj reads too: the CPU kernel writes it heads-last, so the transpose's
//   contiguous copy is the same tensor) and its log-sum-exp (fp32, per row and head);
//   the residual h (N D); SwiGLU's gate, up, SiLU and their product (4 N I); the output (N D).
//   Backward peaks in SwiGLU (the incoming gradient and three N I gradients) or in attention
//   (the gradients of the queries, keys and values and the output's).
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
  require(s.tensor_parallel == 1, "tensor_parallel " + std::to_string(s.tensor_parallel) +
                                      ": the Llama family's tensor-parallel memory is not modelled; plan it "
                                      "with tensor_parallel 1 or measure a few steps");
  require(!s.output_head_group, "output_head_group: the Llama family keeps its head in the root");
}

// The root: the embedding, the final norm, and the head unless it is the embedding's weight.
GroupSpec root_group(const LlamaShape& l) {
  const int64_t V = l.vocab_size, D = l.hidden_size;
  GroupSpec g{"", {{"model.embed_tokens.weight", {V, D}}, {"model.norm.weight", {D}}}};
  if (!l.tie_word_embeddings) g.params.push_back({"lm_head.weight", {V, D}});
  return g;
}

GroupSpec layer_group(const LlamaShape& l, int64_t i) {
  const int64_t D = l.hidden_size, Q = l.n_heads * l.head_dim, K = l.n_kv_heads * l.head_dim, I = l.intermediate_size;
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

StageSpec layer_stage(const LlamaShape& l, const ActivationOptions& a, int64_t i, int64_t n_params) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double B = a.micro_batch, T = a.seq, D = l.hidden_size, I = l.intermediate_size;
  const double Q = static_cast<double>(l.n_heads * l.head_dim), K = static_cast<double>(l.n_kv_heads * l.head_dim);
  const double N = B * T, ND = N * D, kv = l.n_heads > l.n_kv_heads ? Q : K;
  StageSpec s;
  s.name = "model.layers." + std::to_string(i);
  s.group = static_cast<int>(i + 1);
  for (int p = 0; p < n_params; ++p) s.grads.push_back(p);
  s.output_bytes = c * ND;
  const double attention = c * N * (2 * Q + 2 * kv) + 4.0 * B * l.n_heads * T;
  s.saved_bytes = 2 * rms_norm_bytes(c, N, D) + attention + c * (2 * ND + 4 * N * I);
  s.backward_extra_bytes = c * std::max(ND + 3 * N * I, ND + 2 * N * Q + 2 * N * kv);
  s.checkpointed = a.checkpoint_every > 0 && (i + 1) % a.checkpoint_every == 0;
  // The rotary embedding's temporaries; without grad, SwiGLU's or attention's working set.
  s.forward_extra_bytes = s.checkpointed ? c * std::max(ND + 3 * N * I, ND + 3 * N * Q + 2 * N * kv) : c * 2 * N * Q;
  s.forward_flops = 2 * N * (2 * D * Q + 2 * D * K + 3 * D * I) + 4 * B * T * T * Q;
  s.other_bytes_moved = s.saved_bytes * 2;
  return s;
}

StageSpec embedding_stage(const LlamaShape& l, const ActivationOptions& a) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double ND = static_cast<double>(a.micro_batch) * a.seq * l.hidden_size;
  StageSpec emb;
  emb.name = "model.embed_tokens";
  emb.group = 0;
  if (!l.tie_word_embeddings) emb.grads = {0};  // tied: the head's backward made it
  emb.output_bytes = emb.saved_bytes = c * ND;
  emb.forward_extra_bytes = emb.backward_extra_bytes = c * ND;
  emb.other_bytes_moved = 3 * c * ND;
  return emb;
}

// The final norm, the head and the loss (loss_head.h); what the whole head keeps of its input is
// the RMSNorm's.
StageSpec head_stage(const LlamaShape& l, const ActivationOptions& a) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double N = static_cast<double>(a.micro_batch) * a.seq, D = l.hidden_size;
  const double norm = rms_norm_bytes(c, N, D);
  StageSpec head;
  head.name = "lm_head";
  head.group = 0;
  head.grads = l.tie_word_embeddings ? std::vector<int>{0, 1} : std::vector<int>{1, 2};
  set_loss_head(head, a, c, D, static_cast<double>(l.vocab_size), /*saved_input_bytes=*/norm);
  if (head.checkpointed) head.output_bytes = norm + 4 * N;
  return head;
}

}  // namespace

ModelSpec llama_spec(const LlamaShape& l, const ActivationOptions& a, const TransformerSharding& s) {
  check_sizes(l, a, s);
  ModelSpec m;
  m.groups.push_back(root_group(l));
  for (int64_t i = 0; i < l.n_layers; ++i) m.groups.push_back(layer_group(l, i));
  const double N = static_cast<double>(a.micro_batch) * a.seq;
  m.input_bytes = 8.0 * a.global_rows * (a.seq + 1) + 2 * 8.0 * N;
  m.device_input_bytes = 2 * 8.0 * N;
  m.stages.push_back(embedding_stage(l, a));
  for (int64_t i = 0; i < l.n_layers; ++i)
    m.stages.push_back(layer_stage(l, a, i, static_cast<int64_t>(m.groups[static_cast<size_t>(i + 1)].params.size())));
  m.stages.push_back(head_stage(l, a));
  return m;
}

}  // namespace plan
}  // namespace fsdp
