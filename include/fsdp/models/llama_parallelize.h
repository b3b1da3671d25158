// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/llama_parallelize.h — the tensor-parallel plan of the Llama family's decoder
/// (fsdp/models/llama.h), built from tp's layers (fsdp/tensor_parallel.h), beside the model as
/// the Transformer's is (fsdp/models/parallelize.h):
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {world / 2, 2}, {"dp", "tp"});
///   const fsdp::tp::TensorParallelMesh tp(mesh, "tp");
///   torch::manual_seed(0);                 // every rank builds the same model
///   fsdp::models::Llama model(args, [&](fsdp::models::LlamaDecoderLayer& layer) {
///     fsdp::models::parallelize_llama_layer(*layer, args, tp);
///     fsdp::fully_shard(layer, fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(
///                                  fsdp::DataParallelMeshDims().shard("dp")));
///   });
///   fsdp::models::parallelize_llama_rest(*model, tp, fsdp::models::ParallelizeOptions());
///   fsdp::fully_shard(model, ...same options...);
/// \endcode
#pragma once

#include <fsdp/models/llama.h>
#include <fsdp/models/parallelize.h>
#include <fsdp/tensor_parallel.h>

#include <cstdint>

namespace fsdp {
namespace models {

/// The Megatron plan of one decoder layer, in place: q_proj, k_proj, v_proj, gate_proj and up_proj
/// column-parallel (q/k/v biases split with their rows), o_proj and down_proj row-parallel, the
/// norms whole. Tp rank r computes key/value heads r*kv/tp .. (r+1)*kv/tp - 1 and the query heads
/// they serve (consecutive, as grouped-query attention pairs them), so attention needs no
/// communication; per layer 2 all-reduces in forward (o_proj, down_proj) and 2 in backward. The
/// layer must be whole and equal on every tp rank. Throws what check_llama_parallelizable throws.
void parallelize_llama_layer(LlamaDecoderLayerImpl& layer, const LlamaArgs& args, const tp::TensorParallelMesh& tp);
/// After the layers: with options.vocab_parallel(), embed_tokens split by vocabulary and lm_head
/// column-parallel over it (forward then gathers the logits; forward_loss reads the slices), else
/// both whole; then every parameter not yet split is registered whole on tp.mesh(). Throws
/// c10::Error for vocab_parallel with tied embeddings (one tensor cannot be both an embedding's
/// and a head's split; keep them whole) or a vocabulary tp does not divide.
void parallelize_llama_rest(LlamaImpl& model, const tp::TensorParallelMesh& tp, const ParallelizeOptions& options);
/// Both, for a model built whole.
void parallelize(LlamaImpl& model, const tp::TensorParallelMesh& tp, const ParallelizeOptions& options);

/// The checks of the plan, for a trainer before it builds anything: throws c10::Error naming the
/// field when the tp size does not divide num_key_value_heads (each tp rank computes whole
/// key/value heads) or intermediate_size.
void check_llama_parallelizable(const LlamaArgs& args, int64_t tp_size);

}  // namespace models
}  // namespace fsdp
