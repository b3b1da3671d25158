// llama_parallelize.cpp — the Megatron plan of the Llama decoder (fsdp/models/llama_parallelize.h).
// The replacement layers copy their piece of the whole layer; the global generator is left as
// found, since the tp layers' own construction draws values that the copy replaces.
#include <fsdp/models/llama_parallelize.h>

#include <fsdp/dtensor_parameter.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace models {
namespace {

struct KeepGlobalGenerator {
  KeepGlobalGenerator() : state(at::detail::getDefaultCPUGenerator().get_state()) {}
  ~KeepGlobalGenerator() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(state);
  }
  at::Tensor state;
};

template <typename ParallelImpl>
void replace_linear(torch::nn::Module& owner, const std::string& name, torch::nn::Linear& member,
                    const tp::TensorParallelMesh& tp) {
  TORCH_CHECK(!dynamic_cast<const tp::ColumnParallelLinearImpl*>(member.get()) &&
                  !dynamic_cast<const tp::RowParallelLinearImpl*>(member.get()),
              "fsdp::models::parallelize: '", name, "' is already tensor-parallel; parallelize a model once");
  member = owner.replace_module(
      name, torch::nn::Linear(std::shared_ptr<torch::nn::LinearImpl>(std::make_shared<ParallelImpl>(*member, tp))));
}

}  // namespace

void check_llama_parallelizable(const LlamaArgs& args, int64_t tp_size) {
  TORCH_CHECK(tp_size >= 1, "fsdp::models::parallelize: the tensor-parallel size must be >= 1, got ", tp_size);
  TORCH_CHECK(args.num_key_value_heads % tp_size == 0,
              "fsdp::models::parallelize: num_key_value_heads=", args.num_key_value_heads,
              " is not divisible by the tensor-parallel size ", tp_size,
              "; each tp rank computes whole key/value heads (and the query heads they serve), so choose a tp "
              "size that divides num_key_value_heads");
  TORCH_CHECK(args.intermediate_size % tp_size == 0,
              "fsdp::models::parallelize: intermediate_size=", args.intermediate_size,
              " is not divisible by the tensor-parallel size ", tp_size);
}

void parallelize_llama_layer(LlamaDecoderLayerImpl& layer, const LlamaArgs& args, const tp::TensorParallelMesh& tp) {
  check_llama_parallelizable(args, tp.size());
  const KeepGlobalGenerator keep;
  LlamaAttentionImpl& attn = *layer.self_attn;
  replace_linear<tp::ColumnParallelLinearImpl>(attn, "q_proj", attn.q_proj, tp);
  replace_linear<tp::ColumnParallelLinearImpl>(attn, "k_proj", attn.k_proj, tp);
  replace_linear<tp::ColumnParallelLinearImpl>(attn, "v_proj", attn.v_proj, tp);
  replace_linear<tp::RowParallelLinearImpl>(attn, "o_proj", attn.o_proj, tp);
  LlamaMLPImpl& mlp = *layer.mlp;
  replace_linear<tp::ColumnParallelLinearImpl>(mlp, "gate_proj", mlp.gate_proj, tp);
  replace_linear<tp::ColumnParallelLinearImpl>(mlp, "up_proj", mlp.up_proj, tp);
  replace_linear<tp::RowParallelLinearImpl>(mlp, "down_proj", mlp.down_proj, tp);
  for (const auto& p : layer.parameters()) {  // the norms are whole on every tp rank
    if (!dtensor_parameter(p))
      register_dtensor_parameter(p, tp.mesh(), std::vector<Placement>(tp.mesh().ndim(), Replicate()), p.sizes().vec());
  }
}

void parallelize_llama_rest(LlamaImpl& model, const tp::TensorParallelMesh& tp, const ParallelizeOptions& options) {
  if (options.vocab_parallel()) {
    TORCH_CHECK(!model.args().tie_word_embeddings,
                "fsdp::models::parallelize: vocab_parallel with tie_word_embeddings: the one tensor cannot be "
                "split both as the embedding's and as the head's; keep them whole "
                "(ParallelizeOptions().vocab_parallel(false))");
    check_vocab_parallelizable(model.args().vocab_size, tp.size());
    const KeepGlobalGenerator keep;
    LlamaModelImpl& inner = *model.model;
    inner.embed_tokens = inner.replace_module(
        "embed_tokens", torch::nn::Embedding(std::shared_ptr<torch::nn::EmbeddingImpl>(
                            std::make_shared<tp::VocabParallelEmbeddingImpl>(*inner.embed_tokens, tp))));
    replace_linear<tp::ColumnParallelLinearImpl>(model, "lm_head", model.lm_head, tp);
  }
  tp::register_replicated(model, tp);
}

void parallelize(LlamaImpl& model, const tp::TensorParallelMesh& tp, const ParallelizeOptions& options) {
  check_llama_parallelizable(model.args(), tp.size());
  for (auto& layer : model.decoder_layers()) parallelize_llama_layer(*layer, model.args(), tp);
  parallelize_llama_rest(model, tp, options);
}

}  // namespace models
}  // namespace fsdp
