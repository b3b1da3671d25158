// llama_parallelize.cpp — the Megatron plan of the Llama decoder (fsdp/models/llama_parallelize.h).
// The replacement layers copy their piece of the whole layer (tp_replace.h).
#include <fsdp/models/llama_parallelize.h>

#include "src/models/tp_replace.h"

namespace fsdp {
namespace models {

using tp_replace::KeepGlobalGenerator;
using tp_replace::replace_linear;

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
  tp_replace::register_whole(layer, tp);  // the norms are whole on every tp rank
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
    tp_replace::replace_embedding(inner, "embed_tokens", inner.embed_tokens, tp);
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
