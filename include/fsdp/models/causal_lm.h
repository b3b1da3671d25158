// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/causal_lm.h — what every decoder-only language model of fsdp::models shares. A
/// family (the Transformer, the Llama family) writes how tokens become the final norm's output,
/// calling each decoder layer through call_layer, and names its final norm and output head; the
/// logits, the loss with its chunked head, and activation checkpointing per decoder layer are
/// written once, here, over that "hidden states -> head" contract.
///
/// \code{.cpp}
///   class MyModelImpl : public torch::nn::Module, public fsdp::models::CausalLM {
///     at::Tensor forward(const at::Tensor& tokens) { return logits(tokens); }
///    protected:
///     at::Tensor normed_hidden_states(const at::Tensor& tokens) override {
///       at::Tensor h = fsdp::call(embedding, tokens);
///       for (int64_t i = 0; i < n; ++i) h = call_layer(i, layers_[i], h);
///       return fsdp::call(norm, h);
///     }
///     ...
///   };
///   model->set_activation_checkpointing(1);  // every decoder layer
///   at::Tensor loss = fsdp::call_method(model, &MyModelImpl::forward_loss, tokens, targets, int64_t{8});
/// \endcode
#pragma once

#include <fsdp/call.h>
#include <fsdp/checkpoint_activations.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace fsdp {
namespace models {

/// The targets' value that adds nothing to the loss (cross_entropy's default ignore_index).
constexpr int64_t kIgnoreIndex = -100;

/// A decoder-only language model: tokens -> embeddings -> decoder layers -> final norm -> output
/// head. Derive from torch::nn::Module and from this.
class CausalLM {
 public:
  virtual ~CausalLM() = default;

  /// float32 logits [batch, seq, vocab] of tokens (int64 [batch, seq]): the head over the final
  /// norm's output, in fp32 whatever the compute dtype; a head split by vocabulary over tensor
  /// parallelism gathers its slices (collective over its tp group).
  at::Tensor logits(const at::Tensor& tokens);

  /// The mean fp32 cross-entropy of logits(tokens) against targets (int64 [batch, seq] class
  /// indices; kIgnoreIndex rows are not counted), computed in `chunks` pieces of the batch x seq
  /// rows: rows / chunks each, the first rows % chunks one longer. chunks = 1 is exactly
  /// cross_entropy(logits(tokens).reshape({-1, vocab}), targets.reshape({-1})). With chunks > 1
  /// the output head and the loss run as one autograd node, chunked_linear_cross_entropy, called
  /// through fsdp::call_as_forward on the head (so an FSDP group holding it gathers, and hooks its
  /// backward, around it): only one piece's logits and their gradient exist at a time, in forward
  /// and in backward, and the head's weight gets one gradient. The loss and gradients are those of
  /// chunks = 1 up to float rounding; backward computes the head's matmul once more. A head split
  /// by vocabulary reads the slices where they are (the logits are never gathered). Draws no
  /// random numbers of its own. Call it through fsdp::call_method on an FSDP root so that FSDP's
  /// hooks run as for forward. Throws c10::Error unless 1 <= chunks <= seq, or when targets' shape
  /// differs from tokens'.
  at::Tensor forward_loss(const at::Tensor& tokens, const at::Tensor& targets, int64_t chunks);

  /// Activation checkpointing of the decoder layers: layer i (from 0) is called through
  /// fsdp::call_checkpointed(options, layer, ...) when every_k > 0 and (i + 1) % every_k == 0, so
  /// 1 checkpoints every layer and 2 layers 1, 3, 5, ... (torchtitan's selective layer
  /// checkpointing counts the same way); 0, the default, none. Results and gradients are those of
  /// the model without checkpointing; forward keeps less memory, backward computes the
  /// checkpointed layers' forward again. Not collective, but under FSDP every rank must choose the
  /// same. Throws c10::Error for a negative every_k, and for options checkpoint() refuses
  /// (use_reentrant(false)) when every_k > 0.
  void set_activation_checkpointing(int64_t every_k, const CheckpointOptions& options = CheckpointOptions());
  /// Whether decoder layer `index` is called through fsdp::call_checkpointed under the current setting.
  bool is_layer_checkpointed(int64_t index) const {
    return checkpoint_every_k_ > 0 && (index + 1) % checkpoint_every_k_ == 0;
  }

  /// The decoder layers in order: the units of activation checkpointing, and the FSDP groups a
  /// trainer gives each a fully_shard call of its own.
  virtual std::vector<std::shared_ptr<torch::nn::Module>> decoder_layer_modules() = 0;
  /// The final norm, whose output the head reads.
  virtual std::shared_ptr<torch::nn::Module> final_norm_module() = 0;
  /// The output head: a Linear of weight [vocab, dim] (this rank's rows when split by vocabulary),
  /// the embedding's tensor when the two are tied.
  virtual torch::nn::Linear& output_head() = 0;
  /// The vocabulary's size: the logits' last dim.
  virtual int64_t vocab_size() const = 0;

 protected:
  /// tokens (int64 [batch, seq]) -> the final norm's output [batch, seq, dim]: the family's
  /// embeddings and decoder layers (each called through call_layer) and its final norm.
  virtual at::Tensor normed_hidden_states(const at::Tensor& tokens) = 0;

  /// Calls decoder layer `index`, through fsdp::call_checkpointed when is_layer_checkpointed(index),
  /// else through fsdp::call.
  template <typename LayerPtr, typename... Args>
  at::Tensor call_layer(int64_t index, LayerPtr& layer, Args&&... args) {
    if (is_layer_checkpointed(index))
      return fsdp::call_checkpointed(checkpoint_options_, layer, std::forward<Args>(args)...);
    return fsdp::call(layer, std::forward<Args>(args)...);
  }

 private:
  int64_t checkpoint_every_k_ = 0;
  CheckpointOptions checkpoint_options_;
};

/// Each parameter of `model` once: parameters() lists a tied tensor once per module that
/// registers it (an embedding and a head), and an optimizer given it twice would step it twice.
std::vector<at::Tensor> unique_parameters(const torch::nn::Module& model);

}  // namespace models
}  // namespace fsdp
