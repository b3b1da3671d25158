// tied_head.h — private to src/models: the output head that shares the embedding's tensor, as
// transformers' tie_word_embeddings does (GPT-2's wte, the Llama family's embed_tokens).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>

#include <memory>

namespace fsdp {
namespace models {
namespace tied_head {

// A bias-free Linear whose weight is `embedding_weight` itself, registered as its own "weight",
// so that the state dict names it lm_head.weight too and FSDP sees one tensor in two modules.
class TiedHeadImpl : public torch::nn::LinearImpl {
 public:
  explicit TiedHeadImpl(const at::Tensor& embedding_weight)
      : torch::nn::LinearImpl(
            torch::nn::LinearOptions(embedding_weight.size(1), embedding_weight.size(0)).bias(false)) {
    weight = embedding_weight;
    parameters_["weight"] = embedding_weight;
  }
};

// The head over an embedding of [vocab, hidden]: logits = x @ embedding_weight^T.
inline torch::nn::Linear make(const at::Tensor& embedding_weight) {
  return torch::nn::Linear(std::shared_ptr<torch::nn::LinearImpl>(std::make_shared<TiedHeadImpl>(embedding_weight)));
}

}  // namespace tied_head
}  // namespace models
}  // namespace fsdp
