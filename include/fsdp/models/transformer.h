// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/transformer.h — a small decoder-only Transformer for examples, tests and
/// benchmarks. Its architecture and parameter names are those of the Transformer in PyTorch's
/// FSDP2 example (ModelArgs, tok_embeddings, `layers.<i>.attention.wq`, ...), so state dicts can be
/// exchanged with a Python model written the same way.
///
/// \code{.cpp}
///   tokens -> tok_embeddings + pos_embeddings -> dropout -> n_layers x TransformerBlock
///          -> norm (LayerNorm) -> output (Linear, no bias) -> float logits
///   TransformerBlock(x): h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))
///   Attention: wq, wk, wv, wo (Linear, no bias), causal softmax(QK^T / sqrt(head_dim)),
///              dropout on the probabilities and on the output projection.
///   FeedForward: w1 (Linear with bias) -> GELU -> w2 (Linear with bias) -> dropout.
/// \endcode
///
/// Submodules are called through fsdp::call, so any of them may be fully_shard()ed:
///
/// \code{.cpp}
///   auto model = fsdp::models::Transformer(fsdp::models::ModelArgs::preset("small"));
///   for (auto& block : model->blocks()) fsdp::fully_shard(block);
///   fsdp::fully_shard(model);
///   at::Tensor logits = fsdp::call(model, tokens);   // tokens: int64 [batch, seq]
/// \endcode
///
/// A model larger than one rank's memory: build it sharded, one block at a time, so that no rank
/// ever holds all of its parameters (see sharded_transformer below):
///
/// \code{.cpp}
///   torch::manual_seed(0);  // the same seed on every rank, as for the usual build
///   auto model = fsdp::models::sharded_transformer(args, fsdp::FullyShardOptions().mesh(mesh),
///                                                  fsdp::FullyShardOptions().mesh(mesh));
/// \endcode
///
/// model->set_activation_checkpointing(1) recomputes every block's activations in backward
/// instead of keeping them (fsdp/checkpoint_activations.h); 2 every other block.
///
/// forward_loss computes the training loss without the whole logits ever in memory: the
/// batch x sequence rows in `chunks` pieces, the output head and fp32 cross-entropy of each
/// computed by one autograd function (fsdp/models/linear_cross_entropy.h) that recomputes one
/// piece's logits at a time in backward:
///
/// \code{.cpp}
///   at::Tensor loss = fsdp::call_method(model, &fsdp::models::TransformerImpl::forward_loss,
///                                       tokens, targets, int64_t{8});
/// \endcode
#pragma once

#include <fsdp/checkpoint_activations.h>
#include <fsdp/models/causal_lm.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

struct FullyShardOptions;  ///< fsdp/fully_shard.h

namespace models {

/// The reference Transformer's shape (the trainer's `model` section); the defaults are "tiny".
struct ModelArgs {
  int64_t n_layers = 2;      ///< blocks
  int64_t vocab_size = 8;    ///< tokens of the vocabulary (rows of the embedding, outputs of the head)
  int64_t max_seq_len = 16;  ///< positions of the learned position embedding
  int64_t dim = 16;          ///< model width
  int64_t n_heads = 4;       ///< attention heads; must divide dim
  double dropout_p = 0.1;  ///< dropout of the attention probabilities, after the embeddings and on each residual branch

  /// "tiny" (the defaults above), "small" (4 layers, dim 256, 8 heads, vocab 8192, seq 256) or
  /// "medium" (8 layers, dim 768, 12 heads, vocab 32000, seq 512). Throws c10::Error on any
  /// other name.
  static ModelArgs preset(const std::string& name);
  /// The preset names, in size order.
  static std::vector<std::string> preset_names();
};

/// Causal multi-head self-attention: projections wq, wk, wv, the output projection wo, and
/// dropout on its output.
class AttentionImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// Built from `args` (dim, n_heads, dropout_p); forward(x): x [batch, seq, dim] -> the same shape.
  explicit AttentionImpl(const ModelArgs& args);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  /** @{ */
  /// Its submodules, under these names.
  torch::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};
  /** @} */

 private:
  int64_t n_heads_;
  int64_t head_dim_;
  double dropout_p_;
};
TORCH_MODULE(Attention);

/// The MLP of a block: w2(gelu(w1(x))), then dropout.
class FeedForwardImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// dim -> hidden_dim -> dim; forward(x): x [batch, seq, dim] -> the same shape.
  FeedForwardImpl(int64_t dim, int64_t hidden_dim, double dropout_p);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  /** @{ */
  /// Its submodules, under these names.
  torch::nn::Linear w1{nullptr}, w2{nullptr};
  torch::nn::Dropout resid_dropout{nullptr};
  /** @} */
};
TORCH_MODULE(FeedForward);

/// A pre-norm block: h = x + attention(attention_norm(x)), then h + feed_forward(ffn_norm(h)), each
/// submodule called through fsdp::call.
class TransformerBlockImpl : public torch::nn::Module {
 public:
  /** @{ */
  /// Built from `args` (the MLP's hidden width is 4 x dim); forward(x): x [batch, seq, dim] -> the
  /// same shape.
  explicit TransformerBlockImpl(const ModelArgs& args);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

  /** @{ */
  /// Its submodules, under these names.
  torch::nn::LayerNorm attention_norm{nullptr};
  Attention attention{nullptr};
  torch::nn::LayerNorm ffn_norm{nullptr};
  FeedForward feed_forward{nullptr};
  /** @} */
};
TORCH_MODULE(TransformerBlock);

/// Called with each block of a Transformer under construction; see TransformerImpl's constructor.
using BlockBuiltHook = std::function<void(TransformerBlock& block)>;

/// The reference Transformer that fsdp-train trains: token and position embeddings, n_layers
/// blocks, a final LayerNorm and the output head.
class TransformerImpl : public torch::nn::Module, public CausalLM {
 public:
  /// Builds, in this order: tok_embeddings, pos_embeddings, the blocks layers.0 .. `layers.<n-1>`,
  /// norm, output; each module draws its initial values from the global generator when it is
  /// built (seed it with torch::manual_seed). on_block_built, when set, is called with each block
  /// right after it is built and registered, before the next one is built: fully_shard(block)
  /// there frees the block's full parameters at once, so that at most one block is ever whole.
  /// A hook that draws no random numbers (fully_shard draws none) leaves every value as it is
  /// without a hook, bit for bit. An exception from the hook propagates out of the constructor.
  explicit TransformerImpl(const ModelArgs& args, const BlockBuiltHook& on_block_built = nullptr);
  /// tokens: int64 [batch, seq] with seq <= max_seq_len. Returns float32 logits [batch, seq, vocab]
  /// (CausalLM::logits). The loss is CausalLM::forward_loss (fsdp/models/causal_lm.h), the
  /// blocks' activation checkpointing CausalLM::set_activation_checkpointing.
  at::Tensor forward(const at::Tensor& tokens) { return logits(tokens); }

  const ModelArgs& args() const { return args_; }  ///< the shape it was built with
  /// The blocks, typed (they are also registered as "`layers.<i>`").
  std::vector<TransformerBlock>& blocks() { return blocks_; }
  /// Whether block `index` is called through fsdp::call_checkpointed under the current setting
  /// (CausalLM::is_layer_checkpointed).
  bool is_block_checkpointed(int64_t index) const { return is_layer_checkpointed(index); }

  /** @{ */
  /// CausalLM's parts: the blocks, the final norm, the output head, the vocabulary.
  std::vector<std::shared_ptr<torch::nn::Module>> decoder_layer_modules() override;
  std::shared_ptr<torch::nn::Module> final_norm_module() override { return norm.ptr(); }
  torch::nn::Linear& output_head() override { return output; }
  int64_t vocab_size() const override { return args_.vocab_size; }
  /** @} */

  /** @{ */
  /// Its submodules, under these names (the blocks are `layers`).
  torch::nn::Embedding tok_embeddings{nullptr}, pos_embeddings{nullptr};
  torch::nn::Dropout dropout{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear output{nullptr};
  /** @} */

 protected:
  /// Embeddings, blocks and the final norm.
  at::Tensor normed_hidden_states(const at::Tensor& tokens) override;

 private:
  ModelArgs args_;
  std::vector<TransformerBlock> blocks_;
};
TORCH_MODULE(Transformer);

/// The Transformer built sharded, for models larger than one rank's memory: each block is
/// fully_shard()ed with block_options as soon as it is built, then the whole model (the root:
/// embeddings, final norm and output head) with root_options. The same FSDP groups, options and
/// parameter values as building Transformer(args) and then sharding the blocks and the root in
/// the usual way (fsdp/fully_shard.h), but the full parameters never exist together: a rank holds
/// at most the root's own parameters, one block whole and the shards of the blocks before it,
/// plus that block's shard while fully_shard copies it. Collective over the meshes of the options,
/// like fully_shard; every rank seeds the global generator the same way first. Throws what
/// fully_shard throws.
Transformer sharded_transformer(const ModelArgs& args, const FullyShardOptions& block_options,
                                const FullyShardOptions& root_options);

/// The same with the final norm and the output head as one FSDP group of their own, sharded with
/// head_options after the blocks and before the root (the root keeps the embeddings):
/// fully_shard({model->norm, model->output}, head_options) on a model built the usual way. Their
/// backward comes first, so the group reduce-scatters its gradients and frees its gathered
/// parameters right after it, before the blocks' backward, instead of keeping both to the root's
/// reduce-scatter at the end of backward (with forward_loss's chunks > 1 the head is one autograd
/// node, called once, so this holds for the chunked loss too).
/// The values and the loss are those of the three-options form; the collectives are one more
/// group's.
Transformer sharded_transformer(const ModelArgs& args, const FullyShardOptions& block_options,
                                const FullyShardOptions& head_options, const FullyShardOptions& root_options);

/// Number of elements of all parameters of `module` (as registered now: after fully_shard,
/// the local shards).
int64_t count_parameters(const torch::nn::Module& module);

}  // namespace models
}  // namespace fsdp
