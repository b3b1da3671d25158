// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/llama.h — the decoder of Hugging Face's LlamaForCausalLM family (Llama, Mistral
/// without a sliding window, Qwen2), with the parameter names of transformers' state dict, so
/// that a checkpoint maps one to one:
///
/// \code{.cpp}
///   model.embed_tokens.weight
///   model.layers.<i>.self_attn.{q,k,v,o}_proj.weight   (q/k/v .bias too with attention_bias)
///   model.layers.<i>.mlp.{gate,up,down}_proj.weight
///   model.layers.<i>.{input,post_attention}_layernorm.weight
///   model.norm.weight
///   lm_head.weight                                      (the embedding itself when tied)
///
///   tokens -> embed_tokens -> num_hidden_layers x LlamaDecoderLayer -> norm (RMSNorm) -> lm_head
///   LlamaDecoderLayer(x): h = x + self_attn(input_layernorm(x));
///                         out = h + mlp(post_attention_layernorm(h))
///   self_attn: rotary embeddings on q and k (rope_theta, rope_type "default" or "llama3"),
///              grouped-query attention (each key/value head serves num_attention_heads /
///              num_key_value_heads consecutive query heads), causal softmax(QK^T / sqrt(head_dim)).
///   mlp: down_proj(silu(gate_proj(x)) * up_proj(x)).
/// \endcode
///
/// The rotary table (the inverse frequencies) is a tensor of the model that is neither a
/// parameter nor a registered buffer: LibTorch has no non-persistent buffers, and transformers
/// writes none, so it is in no state dict and no checkpoint; FSDP leaves it whole on every rank,
/// and it follows the hidden states to their device.
///
/// With tie_word_embeddings, lm_head's weight is the embedding's tensor (registered under both
/// names, as in transformers' state dict); fully_shard the root to hold it (as below), since a
/// fully_shard of lm_head alone would split one tensor across two groups, which fully_shard
/// refuses naming it.
///
/// \code{.cpp}
///   fsdp::models::LlamaArgs args;                  // or llama_args_from_hf_config (llama_hf.h)
///   auto model = fsdp::models::Llama(args);
///   for (auto& layer : model->decoder_layers()) fsdp::fully_shard(layer);
///   fsdp::fully_shard(model);
///   at::Tensor logits = fsdp::call(model, tokens);   // tokens: int64 [batch, seq]
///   at::Tensor loss = fsdp::call_method(model, &fsdp::models::LlamaImpl::forward_loss, tokens, targets,
///                                       int64_t{1});
/// \endcode
#pragma once

#include <fsdp/models/causal_lm.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {
namespace models {

/// The rotary embeddings' frequencies: transformers' rope_parameters (or rope_scaling).
struct RopeArgs {
  double theta = 10000.0;  ///< rope_theta: the base of the frequencies
  /// "default" (no scaling) or "llama3" (Llama 3.1's: long wavelengths divided by factor, short
  /// ones kept, the band between interpolated).
  std::string type = "default";
  /** @{ */
  /// "llama3" only: the scaling's factor, low_freq_factor, high_freq_factor and
  /// original_max_position_embeddings, under transformers' names.
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  /** @} */
};

/// The fields of config.json that shape the model, under transformers' names.
struct LlamaArgs {
  /// config.json's architecture, kept so that an export names the family it came from:
  /// "LlamaForCausalLM", "MistralForCausalLM" or "Qwen2ForCausalLM".
  std::string architecture = "LlamaForCausalLM";
  int64_t vocab_size = 64;                ///< rows of the embedding and outputs of the head
  int64_t hidden_size = 32;               ///< model width
  int64_t intermediate_size = 64;         ///< the MLP's width
  int64_t num_hidden_layers = 2;          ///< decoder layers
  int64_t num_attention_heads = 4;        ///< query heads
  int64_t num_key_value_heads = 2;        ///< key/value heads (grouped-query attention)
  int64_t head_dim = 8;                   ///< hidden_size / num_attention_heads unless config.json says otherwise
  int64_t max_position_embeddings = 128;  ///< the longest sequence
  double rms_norm_eps = 1e-6;             ///< the RMSNorms' epsilon
  RopeArgs rope;                          ///< the rotary embeddings' frequencies
  bool attention_bias = false;            ///< Qwen2: q/k/v have biases (o_proj never has one)
  bool tie_word_embeddings = false;       ///< lm_head's weight is the embedding's tensor
  /// Mistral's sliding_window (0: none). The decoder computes full attention, which is the
  /// window's only for sequences no longer than it (check_sequence_length).
  int64_t sliding_window = 0;
  /// The standard deviation of the initial weights (transformers' initializer_range): every
  /// projection and the embedding drawn from N(0, initializer_range^2), biases 0, norms 1.
  double initializer_range = 0.02;

  /// Throws c10::Error naming the field when a size is not positive, num_attention_heads is not a
  /// multiple of num_key_value_heads, head_dim is odd (rotary pairs), or the rope type is unknown.
  void check() const;
  /// Throws c10::Error when a sequence of seq_len tokens is longer than sliding_window (the
  /// decoder computes full attention, not the window's).
  void check_sequence_length(int64_t seq_len) const;
};

/// Root-mean-square norm in fp32: weight * x / sqrt(mean(x^2) + eps), as transformers' LlamaRMSNorm.
class LlamaRMSNormImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// A norm over the last dim of size `dim`; forward(x) keeps x's shape.
  LlamaRMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  at::Tensor weight;  ///< [dim], initialised to 1

 private:
  double eps_;
};
TORCH_MODULE(LlamaRMSNorm);

/// Causal grouped-query attention with rotary embeddings on q and k (see the top of this file).
class LlamaAttentionImpl : public torch::nn::Module {
 public:
  /// Built from `args` (sizes, heads, attention_bias).
  explicit LlamaAttentionImpl(const LlamaArgs& args);
  /// x: [batch, seq, hidden]; cos, sin: [seq, head_dim] from the rotary table.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

  /** @{ */
  /// Its projections, under transformers' names.
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  /** @} */

 private:
  int64_t head_dim_;
  int64_t groups_;  ///< query heads per key/value head
};
TORCH_MODULE(LlamaAttention);

/// SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), without biases.
class LlamaMLPImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// hidden_size -> intermediate_size -> hidden_size; forward(x): [batch, seq, hidden] -> the same.
  explicit LlamaMLPImpl(const LlamaArgs& args);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  /** @{ */
  /// Its projections, under transformers' names.
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  /** @} */
};
TORCH_MODULE(LlamaMLP);

/// A decoder layer: h = x + self_attn(input_layernorm(x)), then h + mlp(post_attention_layernorm(h)).
class LlamaDecoderLayerImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// Built from `args`; forward(x, cos, sin) as LlamaAttentionImpl's, x's shape kept.
  explicit LlamaDecoderLayerImpl(const LlamaArgs& args);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
  /** @} */

  /** @{ */
  /// Its parts, under transformers' names.
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  /** @} */
};
TORCH_MODULE(LlamaDecoderLayer);

/// transformers' LlamaModel: the embedding, the decoder layers and the final norm. Its own
/// forward is LlamaImpl's business (LlamaImpl calls its parts), so that the decoder layers can be
/// FSDP groups of their own and the root holds the rest.
class LlamaModelImpl : public torch::nn::Module {
 public:
  /// Builds the parts in order, calling `on_layer_built` with each decoder layer (see LlamaImpl).
  explicit LlamaModelImpl(const LlamaArgs& args, const std::function<void(LlamaDecoderLayer&)>& on_layer_built);

  /** @{ */
  /// Its parts, under transformers' names.
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  LlamaRMSNorm norm{nullptr};
  /** @} */
  std::vector<LlamaDecoderLayer> decoder_layers;  ///< the layers of `layers`, typed
};
TORCH_MODULE(LlamaModel);

/// Called with each decoder layer right after it is built (fully_shard it there to build a model
/// larger than one rank: at most one layer is ever whole).
using LlamaLayerBuiltHook = std::function<void(LlamaDecoderLayer& layer)>;

/// transformers' LlamaForCausalLM: the LlamaModel and the output head (see the top of this file).
/// The logits, the loss and activation checkpointing per decoder layer are CausalLM's
/// (fsdp/models/causal_lm.h).
class LlamaImpl : public torch::nn::Module, public CausalLM {
 public:
  /// Builds embed_tokens, the layers, norm and lm_head, drawing initial values from the global
  /// generator (seed it the same on every rank) as transformers initialises them (see
  /// LlamaArgs::initializer_range), each module before the hook sees it. Throws what
  /// LlamaArgs::check throws.
  explicit LlamaImpl(const LlamaArgs& args, const LlamaLayerBuiltHook& on_layer_built = nullptr);
  /// tokens: int64 [batch, seq] with seq <= max_position_embeddings. Returns float32 logits
  /// [batch, seq, vocab_size] (CausalLM::logits).
  at::Tensor forward(const at::Tensor& tokens) { return logits(tokens); }

  const LlamaArgs& args() const { return args_; }  ///< the shape it was built with
  /// Each parameter once: parameters() lists the tied embedding twice (as model.embed_tokens
  /// and lm_head), and an optimizer given it twice would step it twice.
  std::vector<at::Tensor> unique_parameters() const { return models::unique_parameters(*this); }
  /// The decoder layers, typed (the FSDP groups of fsdp-train).
  std::vector<LlamaDecoderLayer>& decoder_layers() { return model->decoder_layers; }

  /** @{ */
  /// CausalLM's parts: the decoder layers, the final norm, lm_head, the vocabulary.
  std::vector<std::shared_ptr<torch::nn::Module>> decoder_layer_modules() override;
  std::shared_ptr<torch::nn::Module> final_norm_module() override { return model->norm.ptr(); }
  torch::nn::Linear& output_head() override { return lm_head; }
  int64_t vocab_size() const override { return args_.vocab_size; }
  /** @} */

  LlamaModel model{nullptr};           ///< transformers' `model`
  torch::nn::Linear lm_head{nullptr};  ///< the output head (its weight the embedding's when tied)

 protected:
  /// The final norm's output.
  at::Tensor normed_hidden_states(const at::Tensor& tokens) override;

 private:
  /// cos and sin [seq, head_dim] of positions 0 .. seq-1, on `device`.
  std::pair<at::Tensor, at::Tensor> rotary(int64_t seq, const at::Device& device);

  LlamaArgs args_;
  at::Tensor inv_freq_;  ///< [head_dim / 2], float32: the rotary table (see the top of this file)
};
TORCH_MODULE(Llama);

/// The rotary inverse frequencies of `rope` for head_dim, as transformers computes them
/// (float32), llama3 scaling applied.
at::Tensor rope_inverse_frequencies(const RopeArgs& rope, int64_t head_dim);

}  // namespace models
}  // namespace fsdp
