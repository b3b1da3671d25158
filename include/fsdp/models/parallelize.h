// layer: models (what may include what: docs/architecture.md)
/// \file
/// fsdp/models/parallelize.h — the tensor-parallel plan of the reference Transformer
/// (fsdp/models/transformer.h), built from tp's layers (fsdp/tensor_parallel.h). A model's plan
/// lives beside the model: tp knows no model.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {world / 2, 2}, {"dp", "tp"});
///   torch::manual_seed(0);                              // every rank builds the same full model
///   auto model = fsdp::models::Transformer(args);
///   fsdp::models::parallelize(model, fsdp::tp::TensorParallelMesh(mesh, "tp"),
///                             fsdp::models::ParallelizeOptions().vocab_parallel(true));
///   // then fully_shard over dp (fsdp/tensor_parallel.h shows the calls)
/// \endcode
#pragma once

#include <fsdp/models/transformer.h>
#include <fsdp/tensor_parallel.h>

#include <torch/arg.h>

#include <cstdint>

namespace fsdp {
namespace models {

/// The options of parallelize().
struct ParallelizeOptions {
  /// Split the token embedding and the output head by vocabulary over tp (VocabParallelEmbedding,
  /// and a ColumnParallelLinear head whose logits the Transformer's loss reads without gathering
  /// them: vocab_parallel_cross_entropy). false keeps both whole on every tp rank, each tp rank
  /// then computing the head and the loss for all of its tp group's rows.
  TORCH_ARG(bool, vocab_parallel) = false;
};

/// The Megatron plan for the reference Transformer (fsdp/models/transformer.h), in place, on
/// every rank of `tp.mesh()`:
///  - attention: wq, wk, wv column-parallel, wo row-parallel, so each tp rank computes
///    n_heads / tp whole heads (heads h*tp_rank.. of the full model, in order); wq, wk and wv
///    share one all-reduce of their input's gradient (call_linears_on_shared_input);
///  - feed-forward: w1 column-parallel, w2 row-parallel (the GELU between them is elementwise);
///  - with options.vocab_parallel(), tok_embeddings a VocabParallelEmbedding and the output head
///    a ColumnParallelLinear over the vocabulary (Shard(0) on tp, both); the Transformer's
///    forward then all-gathers the logits over tp (every tp rank returns the whole logits) and
///    its forward_loss computes the loss from each rank's slice (vocab_parallel_cross_entropy,
///    or the chunked head and loss of fsdp/models/linear_cross_entropy.h);
///  - pos_embeddings, the norms, and without vocab_parallel the token embedding and the output
///    head, stay whole on every tp rank (Replicate()). Their gradients are the same on every tp
///    rank, since every tp rank sees the same activations outside the split layers.
/// Per block that is 4 all-reduces of the block's activations on the tp group: 2 in forward (wo,
/// w2), 2 in backward (the attention's input, w1's input); vocab_parallel adds 2 more (the
/// embedding's output in forward, the head's input gradient in backward) and the loss's 2 of a
/// few bytes a row.
/// Every parameter is then registered as a DTensor on tp.mesh() (fsdp/dtensor_parameter.h).
/// The model must be whole and equal on every tp rank (the same seed), before fully_shard.
/// Throws c10::Error when n_heads or dim (or, with vocab_parallel, vocab_size) is not divisible by
/// the tp size, naming them. The tp rank's forward then needs the whole batch of its tp group
/// (the same input on every tp rank).
void parallelize(TransformerImpl& model, const tp::TensorParallelMesh& tp,
                 const ParallelizeOptions& options = ParallelizeOptions());
/** @{ */
/// The same, a piece at a time, for a model built block by block (so that the whole model never
/// exists on one rank: sharded_transformer's way): parallelize_block on each block as it is built
/// (the hook of TransformerImpl's constructor, before fully_shard of the block), then on the
/// finished model parallelize_vocab when vocab_parallel, then tp::register_replicated for the
/// parameters outside the blocks that stay whole. Together they do exactly what parallelize does.
void parallelize_block(TransformerBlockImpl& block, const ModelArgs& args, const tp::TensorParallelMesh& tp);
void parallelize_vocab(TransformerImpl& model, const tp::TensorParallelMesh& tp);
/** @} */
/// parallelize() for a LibTorch module holder (a Transformer).
template <typename Holder>
void parallelize(Holder& model, const tp::TensorParallelMesh& tp,
                 const ParallelizeOptions& options = ParallelizeOptions()) {
  parallelize(*model, tp, options);
}

/** @{ */
/// The checks parallelize makes, for callers that want them before building anything (e.g. a
/// trainer reading its configuration): throws c10::Error naming the model field and the tp size.
void check_parallelizable(int64_t n_heads, int64_t dim, int64_t tp_size);
void check_vocab_parallelizable(int64_t vocab_size, int64_t tp_size);
/** @} */

}  // namespace models
}  // namespace fsdp
