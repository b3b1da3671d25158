// tp_replace.h — private to src/models: the steps both models' Megatron plans take
// (parallelize.cpp for the reference Transformer, llama_parallelize.cpp for the Llama family):
// replace a whole Linear or Embedding by tp's layer that copies its piece, refuse a layer that is
// already split, mark what stays whole, and leave the global generator as it was found.
#pragma once

#include <fsdp/dtensor_parameter.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace models {
namespace tp_replace {

// A plan builds tp layers whose construction draws values that the copy of the whole layer then
// replaces; the caller's global generator must not move because of that.
struct KeepGlobalGenerator {
  KeepGlobalGenerator() : state(at::detail::getDefaultCPUGenerator().get_state()) {}
  ~KeepGlobalGenerator() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(state);
  }
  at::Tensor state;
};

// Throws, naming the layer, when it is already one of tp's split layers.
inline void check_whole(const torch::nn::Module& module, const std::string& name) {
  TORCH_CHECK(!dynamic_cast<const tp::ColumnParallelLinearImpl*>(&module) &&
                  !dynamic_cast<const tp::RowParallelLinearImpl*>(&module) &&
                  !dynamic_cast<const tp::VocabParallelEmbeddingImpl*>(&module),
              "fsdp::models::parallelize: '", name, "' is already tensor-parallel; parallelize a model once");
}

// owner.name (a whole Linear) becomes ParallelImpl (column- or row-parallel) holding its piece.
template <typename ParallelImpl>
void replace_linear(torch::nn::Module& owner, const std::string& name, torch::nn::Linear& member,
                    const tp::TensorParallelMesh& tp) {
  check_whole(*member, name);
  member = owner.replace_module(
      name, torch::nn::Linear(std::shared_ptr<torch::nn::LinearImpl>(std::make_shared<ParallelImpl>(*member, tp))));
}

// owner.name (a whole Embedding) becomes a vocab-parallel embedding holding its rows.
inline void replace_embedding(torch::nn::Module& owner, const std::string& name, torch::nn::Embedding& member,
                              const tp::TensorParallelMesh& tp) {
  check_whole(*member, name);
  member = owner.replace_module(name, torch::nn::Embedding(std::shared_ptr<torch::nn::EmbeddingImpl>(
                                          std::make_shared<tp::VocabParallelEmbeddingImpl>(*member, tp))));
}

// The parameters of `module` that no tp layer took (norms) are recorded as whole on every tp rank.
inline void register_whole(const torch::nn::Module& module, const tp::TensorParallelMesh& tp) {
  for (const auto& p : module.parameters()) {
    if (!dtensor_parameter(p))
      register_dtensor_parameter(p, tp.mesh(), std::vector<Placement>(tp.mesh().ndim(), Replicate()), p.sizes().vec());
  }
}

}  // namespace tp_replace
}  // namespace models
}  // namespace fsdp
