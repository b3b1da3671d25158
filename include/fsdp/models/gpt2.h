// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/gpt2.h — transformers' GPT2LMHeadModel (OpenAI's GPT-2, llm.c's model) with the
/// parameter names and shapes of transformers' state dict, so that a checkpoint maps one to one:
///
/// \code{.cpp}
///   transformer.wte.weight                         [vocab_size, n_embd]   token embedding
///   transformer.wpe.weight                         [n_positions, n_embd]  learned positions
///   transformer.h.<i>.ln_1.{weight,bias}           [n_embd]
///   transformer.h.<i>.attn.c_attn.{weight,bias}    [n_embd, 3 n_embd], [3 n_embd]  (q | k | v)
///   transformer.h.<i>.attn.c_proj.{weight,bias}    [n_embd, n_embd], [n_embd]
///   transformer.h.<i>.ln_2.{weight,bias}           [n_embd]
///   transformer.h.<i>.mlp.c_fc.{weight,bias}       [n_embd, n_inner], [n_inner]
///   transformer.h.<i>.mlp.c_proj.{weight,bias}     [n_inner, n_embd], [n_embd]
///   transformer.ln_f.{weight,bias}                 [n_embd]
///   lm_head.weight                                 [vocab_size, n_embd]  (wte's tensor when tied)
///
///   tokens -> wte(tokens) + wpe(0 .. seq-1) -> dropout(embd_pdrop) -> n_layer x Gpt2Block -> ln_f -> lm_head
///   Gpt2Block(x): h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))
///   attn: q, k, v = split(c_attn(x)); causal softmax(q k^T * scale) v over n_head heads
///         (scale 1 / sqrt(head_dim), or 1 without scale_attn_weights), dropout(attn_pdrop) on the
///         probabilities, then c_proj and dropout(resid_pdrop)
///   mlp: dropout(resid_pdrop)(c_fc -> activation -> c_proj), the activation gelu_new (GELU's
///        tanh approximation, transformers' and GPT-2's default), gelu_pytorch_tanh (the same) or gelu.
/// \endcode
///
/// The projections are transformers' Conv1D (Gpt2Conv1D here): a weight stored [in, out], the
/// transpose of a Linear's, and forward x @ weight + bias. They are kept so, not transposed on
/// load, so that a file's tensors are the parameters as they are.
///
/// With tie_word_embeddings (GPT-2's default), lm_head's weight is wte's tensor, registered under
/// both names as in transformers' state dict; fully_shard the root to hold it.
///
/// \code{.cpp}
///   fsdp::models::Gpt2Args args;                   // or gpt2_args_from_hf_config (gpt2_hf.h)
///   auto model = fsdp::models::Gpt2(args);
///   for (auto& block : model->blocks()) fsdp::fully_shard(block);
///   fsdp::fully_shard(model);
///   at::Tensor logits = fsdp::call(model, tokens);   // tokens: int64 [batch, seq]
///   at::Tensor loss = fsdp::call_method(model, &fsdp::models::Gpt2Impl::forward_loss, tokens, targets,
///                                       int64_t{1});
/// \endcode
#pragma once

#include <fsdp/models/causal_lm.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {
namespace models {

/// The fields of config.json (transformers' GPT2Config) that shape the model, under its names.
struct Gpt2Args {
  int64_t vocab_size = 64;           ///< rows of wte and outputs of the head
  int64_t n_positions = 128;         ///< rows of wpe: the longest sequence
  int64_t n_embd = 32;               ///< model width
  int64_t n_layer = 2;               ///< blocks
  int64_t n_head = 4;                ///< attention heads (head_dim = n_embd / n_head)
  int64_t n_inner = 128;             ///< the MLP's width (config.json's null: 4 n_embd)
  double layer_norm_epsilon = 1e-5;  ///< the LayerNorms' epsilon
  /// "gelu_new" (GELU's tanh approximation), "gelu_pytorch_tanh" (the same) or "gelu" (erf).
  std::string activation_function = "gelu_new";
  bool scale_attn_weights = true;   ///< scores scaled by 1 / sqrt(head_dim); false: not scaled
  bool tie_word_embeddings = true;  ///< lm_head's weight is wte's tensor
  /** @{ */
  /// Dropout's probabilities in training (none in eval mode): after the embeddings, on the
  /// attention's probabilities, after each residual branch.
  double embd_pdrop = 0.0;
  double attn_pdrop = 0.0;
  double resid_pdrop = 0.0;
  /** @} */
  /// The standard deviation of the initial weights (transformers' initializer_range): wte, wpe
  /// and every projection from N(0, initializer_range^2), each c_proj's from N(0,
  /// initializer_range^2 / (2 n_layer)) (GPT-2's scaled residual init), biases 0, LayerNorms 1 and 0.
  double initializer_range = 0.02;

  /// Throws c10::Error naming the field when a size is not positive, n_embd is not a multiple of
  /// n_head, a dropout probability is outside [0, 1), or the activation is not one of the three.
  void check() const;
};

/// transformers' Conv1D: y = x @ weight + bias, weight stored [in, out].
class Gpt2Conv1DImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// in -> out features; forward(x): [..., in] -> [..., out].
  Gpt2Conv1DImpl(int64_t in, int64_t out);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  at::Tensor weight;  ///< [in, out]
  at::Tensor bias;    ///< [out]
};
TORCH_MODULE(Gpt2Conv1D);

/// Causal multi-head attention with the fused c_attn (see the top of this file).
class Gpt2AttentionImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// Built from `args`; forward(x): [batch, seq, n_embd] -> the same.
  explicit Gpt2AttentionImpl(const Gpt2Args& args);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  /** @{ */
  /// Its projections, under transformers' names.
  Gpt2Conv1D c_attn{nullptr}, c_proj{nullptr};
  /** @} */

 private:
  int64_t n_head_;
  double scale_;
  double attn_pdrop_, resid_pdrop_;
};
TORCH_MODULE(Gpt2Attention);

/// The MLP: dropout(c_proj(activation(c_fc(x)))).
class Gpt2MLPImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// n_embd -> n_inner -> n_embd; forward(x): [batch, seq, n_embd] -> the same.
  explicit Gpt2MLPImpl(const Gpt2Args& args);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  /** @{ */
  /// Its projections, under transformers' names.
  Gpt2Conv1D c_fc{nullptr}, c_proj{nullptr};
  /** @} */

 private:
  std::string activation_;
  double resid_pdrop_;
};
TORCH_MODULE(Gpt2MLP);

/// A block: h = x + attn(ln_1(x)), then h + mlp(ln_2(h)).
class Gpt2BlockImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// Built from `args`; forward(x) keeps x's shape.
  explicit Gpt2BlockImpl(const Gpt2Args& args);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  /** @{ */
  /// Its parts, under transformers' names.
  torch::nn::LayerNorm ln_1{nullptr};
  Gpt2Attention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  Gpt2MLP mlp{nullptr};
  /** @} */
};
TORCH_MODULE(Gpt2Block);

/// transformers' GPT2Model: the embeddings, the blocks and the final norm. Its forward is
/// Gpt2Impl's business (Gpt2Impl calls its parts), so that the blocks can be FSDP groups of their
/// own and the root holds the rest.
class Gpt2ModelImpl : public torch::nn::Module {
 public:
  /// Builds the parts in order, calling `on_block_built` with each block (see Gpt2Impl).
  Gpt2ModelImpl(const Gpt2Args& args, const std::function<void(Gpt2Block&)>& on_block_built);

  /** @{ */
  /// Its parts, under transformers' names.
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  /** @} */
  std::vector<Gpt2Block> blocks;  ///< the blocks of `h`, typed
};
TORCH_MODULE(Gpt2Model);

/// Called with each block right after it is built (fully_shard it there to build a model larger
/// than one rank: at most one block is ever whole).
using Gpt2BlockBuiltHook = std::function<void(Gpt2Block& block)>;

/// transformers' GPT2LMHeadModel: the GPT2Model and the output head (see the top of this file).
/// The logits, the loss and activation checkpointing per block are CausalLM's
/// (fsdp/models/causal_lm.h).
class Gpt2Impl : public torch::nn::Module, public CausalLM {
 public:
  /// Builds wte, wpe, the blocks, ln_f and lm_head, drawing initial values from the global
  /// generator (seed it the same on every rank) as transformers initialises them (see
  /// Gpt2Args::initializer_range), each module before the hook sees it. Throws what
  /// Gpt2Args::check throws.
  explicit Gpt2Impl(const Gpt2Args& args, const Gpt2BlockBuiltHook& on_block_built = nullptr);
  /// tokens: int64 [batch, seq] with seq <= n_positions. Returns float32 logits [batch, seq,
  /// vocab_size] (CausalLM::logits).
  at::Tensor forward(const at::Tensor& tokens) { return logits(tokens); }

  const Gpt2Args& args() const { return args_; }  ///< the shape it was built with
  /// Each parameter once (the tied wte is registered twice, as transformer.wte and lm_head).
  std::vector<at::Tensor> unique_parameters() const { return models::unique_parameters(*this); }
  /// The blocks, typed (the FSDP groups of fsdp-train).
  std::vector<Gpt2Block>& blocks() { return transformer->blocks; }

  /** @{ */
  /// CausalLM's parts: the blocks, ln_f, lm_head, the vocabulary.
  std::vector<std::shared_ptr<torch::nn::Module>> decoder_layer_modules() override;
  std::shared_ptr<torch::nn::Module> final_norm_module() override { return transformer->ln_f.ptr(); }
  torch::nn::Linear& output_head() override { return lm_head; }
  int64_t vocab_size() const override { return args_.vocab_size; }
  /** @} */

  Gpt2Model transformer{nullptr};      ///< transformers' `transformer`
  torch::nn::Linear lm_head{nullptr};  ///< the output head (its weight wte's when tied)

 protected:
  /// ln_f's output.
  at::Tensor normed_hidden_states(const at::Tensor& tokens) override;

 private:
  Gpt2Args args_;
};
TORCH_MODULE(Gpt2);

}  // namespace models
}  // namespace fsdp
