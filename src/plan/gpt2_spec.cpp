// gpt2_spec.cpp — fsdp::models::Gpt2 as a ModelSpec: its FSDP groups as the trainer shards them
// and what each part of its forward keeps for backward.
//
// The activation bytes follow the operations of src/models/gpt2/gpt2.cpp, with N = batch x seq
// rows, D = n_embd, I = n_inner, P = batch x heads x seq x seq attention scores, in the compute
// dtype c (bytes):
//   a LayerNorm keeps its output (N D, which the next Conv1D's addmm reads) and its mean and
//   reciprocal deviation (fp32, 2 N);
//   attention keeps c_attn's output (3 N D: q, k and v are views of it), the scaled-dot-product
//   attention's output (N D) and log-sum-exp (fp32, per row and head), and the contiguous copy
//   c_proj reads (N D); the residual h (N D); c_fc's output and GELU's (2 N I); the output (N D).
//   Dropout with p > 0 keeps a one-byte mask and its output at each site (N D after the
//   embeddings and after each residual branch); on the probabilities the attention computes them
//   explicitly and keeps them, their mask and the dropped ones (2 c P + P) instead of the
//   log-sum-exp.
//   Backward peaks in the MLP (the incoming gradient and one N I gradient: autograd frees each
//   saved output as its gradient is made) or in attention (the gradients of q, k, v and the
//   output, and with dropout on the probabilities one P gradient).
// Measured against the trainer's peak at W = 2 (tests/train/test_plan_cli.cpp): within 10 % in
// fp32, bf16, with activation checkpointing, the chunked loss, NO_SHARD, an untied head group
// and dropout.
//   The head keeps ln_f's tensors as above and the loss head's (loss_head.h).
// A tied wte is one parameter of the root, listed once; its gradient is made by the head's
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
  if (!ok) throw std::invalid_argument("fsdp::plan::gpt2_spec: " + what);
}

void check_sizes(const Gpt2Shape& g, const ActivationOptions& a, const TransformerSharding& s) {
  require(
      g.n_layers >= 1 && g.vocab_size >= 1 && g.n_embd >= 1 && g.n_inner >= 1 && g.n_heads >= 1 && g.n_positions >= 1,
      "every size must be >= 1");
  require(g.n_embd % g.n_heads == 0,
          "n_embd " + std::to_string(g.n_embd) + " is not a multiple of n_heads " + std::to_string(g.n_heads));
  require(a.seq >= 1 && a.seq <= g.n_positions,
          "seq " + std::to_string(a.seq) + " must be in [1, n_positions " + std::to_string(g.n_positions) + "]");
  require(a.micro_batch >= 1, "micro_batch must be >= 1");
  require(a.loss_chunks >= 1 && a.loss_chunks <= a.seq,
          "loss_chunks " + std::to_string(a.loss_chunks) + " must be in [1, seq " + std::to_string(a.seq) + "]");
  require(a.checkpoint_every >= 0, "checkpoint_every must be >= 0");
  require(s.tensor_parallel == 1,
          "tensor_parallel " + std::to_string(s.tensor_parallel) + ": GPT-2 has no tensor-parallel plan yet; use 1");
  require(!s.output_head_group || !g.tie_word_embeddings,
          "output_head_group with tie_word_embeddings: the head's weight is wte's, which the root holds");
}

// The root: wte, wpe, and ln_f and the head unless they are a group of their own (or the head is
// wte's weight).
GroupSpec root_group(const Gpt2Shape& g, bool with_head) {
  const int64_t V = g.vocab_size, D = g.n_embd;
  GroupSpec root{"", {{"transformer.wte.weight", {V, D}}, {"transformer.wpe.weight", {g.n_positions, D}}}};
  if (!with_head) return root;
  root.params.insert(root.params.end(), {{"transformer.ln_f.weight", {D}}, {"transformer.ln_f.bias", {D}}});
  if (!g.tie_word_embeddings) root.params.push_back({"lm_head.weight", {V, D}});
  return root;
}

// fully_shard({ln_f, lm_head}): kept gathered from its forward to its backward, which comes first.
GroupSpec head_group(const Gpt2Shape& g) {
  const int64_t V = g.vocab_size, D = g.n_embd;
  GroupSpec head{"transformer.ln_f+lm_head",
                 {{"transformer.ln_f.weight", {D}}, {"transformer.ln_f.bias", {D}}, {"lm_head.weight", {V, D}}}};
  head.reshard_after_forward = false;
  return head;
}

// The Conv1D weights stored [in, out], as transformers' state dict holds them.
GroupSpec block_group(const Gpt2Shape& g, int64_t i) {
  const int64_t D = g.n_embd, I = g.n_inner;
  const std::string p = "transformer.h." + std::to_string(i) + ".";
  return GroupSpec{"transformer.h." + std::to_string(i),
                   {{p + "ln_1.weight", {D}},
                    {p + "ln_1.bias", {D}},
                    {p + "attn.c_attn.weight", {D, 3 * D}},
                    {p + "attn.c_attn.bias", {3 * D}},
                    {p + "attn.c_proj.weight", {D, D}},
                    {p + "attn.c_proj.bias", {D}},
                    {p + "ln_2.weight", {D}},
                    {p + "ln_2.bias", {D}},
                    {p + "mlp.c_fc.weight", {D, I}},
                    {p + "mlp.c_fc.bias", {I}},
                    {p + "mlp.c_proj.weight", {I, D}},
                    {p + "mlp.c_proj.bias", {D}}}};
}

// What one LayerNorm keeps beyond its input: its output and its fp32 statistics.
double layer_norm_bytes(double c, double N, double D) { return c * N * D + 8 * N; }

// What dropout keeps at a site of `elements` values: the one-byte mask and the output.
double dropout_bytes(double p, double c, double elements) { return p > 0 ? (1 + c) * elements : 0; }

StageSpec block_stage(const Gpt2Shape& g, const ActivationOptions& a, int64_t i, int64_t n_params) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double B = a.micro_batch, T = a.seq, D = g.n_embd, I = g.n_inner, H = g.n_heads;
  const double N = B * T, ND = N * D, P = B * H * T * T;
  StageSpec s;
  s.name = "transformer.h." + std::to_string(i);
  s.group = static_cast<int>(i + 1);
  for (int p = 0; p < n_params; ++p) s.grads.push_back(p);
  s.output_bytes = c * ND;
  // With dropout on the probabilities the attention is computed explicitly: the scores'
  // probabilities, their mask and the dropped ones instead of the log-sum-exp.
  const double probabilities = g.attn_pdrop > 0 ? 2 * c * P + P + T * T : 4.0 * B * H * T;
  const double attention = c * (3 * ND + ND + ND) + probabilities;
  s.saved_bytes = 2 * layer_norm_bytes(c, N, D) + attention + c * (ND + 2 * N * I) + s.output_bytes +
                  2 * dropout_bytes(g.resid_pdrop, c, ND);
  // The MLP's backward frees each saved output as it makes its gradient: one N I above the
  // incoming gradient. The attention's holds the gradients of its output and of q, k and v.
  const double attention_backward = 4 * ND + (g.attn_pdrop > 0 ? P : 0);
  s.backward_extra_bytes = c * std::max(ND + N * I, attention_backward);
  s.checkpointed = a.checkpoint_every > 0 && (i + 1) % a.checkpoint_every == 0;
  // Without grad: the MLP's or the attention's working set; with it, c_proj's contiguous input.
  s.forward_extra_bytes =
      s.checkpointed ? c * std::max(ND + 2 * N * I, 5 * ND + (g.attn_pdrop > 0 ? 2 * P : 0)) : c * ND;
  s.forward_flops = 2 * N * (4 * D * D + 2 * D * I) + 4 * B * T * T * D;
  s.other_bytes_moved = s.saved_bytes * 2;
  return s;
}

StageSpec embedding_stage(const Gpt2Shape& g, const ActivationOptions& a) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double N = static_cast<double>(a.micro_batch) * a.seq, ND = N * g.n_embd;
  StageSpec emb;
  emb.name = "transformer.wte+wpe";
  emb.group = 0;
  emb.grads = g.tie_word_embeddings ? std::vector<int>{1} : std::vector<int>{0, 1};  // tied: the head made wte's
  emb.output_bytes = c * ND;
  emb.saved_bytes = emb.output_bytes + dropout_bytes(g.embd_pdrop, c, ND);
  emb.forward_extra_bytes = emb.backward_extra_bytes = c * ND;
  emb.other_bytes_moved = 4 * c * ND;
  return emb;
}

StageSpec head_stage(const Gpt2Shape& g, const ActivationOptions& a, const TransformerSharding& s, int group) {
  const double c = static_cast<double>(bytes_of(a.compute));
  const double N = static_cast<double>(a.micro_batch) * a.seq, D = g.n_embd;
  const double norm = layer_norm_bytes(c, N, D);
  StageSpec head;
  head.name = "lm_head";
  head.group = group;
  if (s.output_head_group) head.grads = {0, 1, 2};
  else head.grads = g.tie_word_embeddings ? std::vector<int>{0, 2, 3} : std::vector<int>{2, 3, 4};
  set_loss_head(head, a, c, D, static_cast<double>(g.vocab_size), /*saved_input_bytes=*/norm);
  if (head.checkpointed) head.output_bytes = norm;
  return head;
}

}  // namespace

ModelSpec gpt2_spec(const Gpt2Shape& g, const ActivationOptions& a, const TransformerSharding& s) {
  check_sizes(g, a, s);
  ModelSpec m;
  m.groups.push_back(root_group(g, !s.output_head_group));
  for (int64_t i = 0; i < g.n_layers; ++i) m.groups.push_back(block_group(g, i));
  if (s.output_head_group) m.groups.push_back(head_group(g));
  const double N = static_cast<double>(a.micro_batch) * a.seq;
  m.input_bytes = 8.0 * a.global_rows * (a.seq + 1) + 2 * 8.0 * N;
  m.device_input_bytes = 2 * 8.0 * N;
  m.stages.push_back(embedding_stage(g, a));
  for (int64_t i = 0; i < g.n_layers; ++i)
    m.stages.push_back(block_stage(g, a, i, static_cast<int64_t>(m.groups[static_cast<size_t>(i + 1)].params.size())));
  m.stages.push_back(head_stage(g, a, s, s.output_head_group ? static_cast<int>(m.groups.size()) - 1 : 0));
  return m;
}

}  // namespace plan
}  // namespace fsdp
