// parallelize.cpp — the Megatron plan for the reference Transformer: which Linear layers are
// column- and which row-parallel, whether the embedding and head are split by vocabulary, and
// the layout record of every parameter, split or whole. Built from tp's layers; tp knows no model.
#include <fsdp/models/parallelize.h>

#include "src/models/tp_replace.h"

namespace fsdp {
namespace models {

using tp_replace::KeepGlobalGenerator;
using tp_replace::replace_linear;

void check_parallelizable(int64_t n_heads, int64_t dim, int64_t tp_size) {
  TORCH_CHECK(tp_size >= 1, "fsdp::models::parallelize: the tensor-parallel size must be >= 1, got ", tp_size);
  TORCH_CHECK(n_heads % tp_size == 0, "fsdp::models::parallelize: n_heads=", n_heads,
              " is not divisible by the tensor-parallel size ", tp_size,
              "; each tp rank computes whole heads, so choose a tp size that divides n_heads");
  TORCH_CHECK(dim % tp_size == 0, "fsdp::models::parallelize: dim=", dim,
              " is not divisible by the tensor-parallel size ", tp_size);
}

void check_vocab_parallelizable(int64_t vocab_size, int64_t tp_size) {
  TORCH_CHECK(tp_size >= 1, "fsdp::models::parallelize: the tensor-parallel size must be >= 1, got ", tp_size);
  TORCH_CHECK(vocab_size % tp_size == 0, "fsdp::models::parallelize: vocab_size=", vocab_size,
              " is not divisible by the tensor-parallel size ", tp_size,
              "; a vocab-parallel embedding and head "
              "give each tp rank vocab_size / tp rows, so choose a tp size that divides it, or keep them whole "
              "(ParallelizeOptions().vocab_parallel(false))");
}

void parallelize_block(TransformerBlockImpl& block, const ModelArgs& args, const tp::TensorParallelMesh& tp) {
  check_parallelizable(args.n_heads, args.dim, tp.size());
  const KeepGlobalGenerator keep;
  AttentionImpl& attention = *block.attention;
  replace_linear<tp::ColumnParallelLinearImpl>(attention, "wq", attention.wq, tp);
  replace_linear<tp::ColumnParallelLinearImpl>(attention, "wk", attention.wk, tp);
  replace_linear<tp::ColumnParallelLinearImpl>(attention, "wv", attention.wv, tp);
  replace_linear<tp::RowParallelLinearImpl>(attention, "wo", attention.wo, tp);
  FeedForwardImpl& ff = *block.feed_forward;
  replace_linear<tp::ColumnParallelLinearImpl>(ff, "w1", ff.w1, tp);
  replace_linear<tp::RowParallelLinearImpl>(ff, "w2", ff.w2, tp);
  tp_replace::register_whole(block, tp);  // the norms are whole on every tp rank
}

void parallelize_vocab(TransformerImpl& model, const tp::TensorParallelMesh& tp) {
  check_vocab_parallelizable(model.args().vocab_size, tp.size());
  const KeepGlobalGenerator keep;
  tp_replace::replace_embedding(model, "tok_embeddings", model.tok_embeddings, tp);
  // The head's rows are the vocabulary: column-parallel, its output this rank's logits.
  replace_linear<tp::ColumnParallelLinearImpl>(model, "output", model.output, tp);
}

void parallelize(TransformerImpl& model, const tp::TensorParallelMesh& tp, const ParallelizeOptions& options) {
  const ModelArgs& args = model.args();
  check_parallelizable(args.n_heads, args.dim, tp.size());
  if (options.vocab_parallel()) check_vocab_parallelizable(args.vocab_size, tp.size());
  for (auto& block : model.blocks()) parallelize_block(*block, args, tp);
  if (options.vocab_parallel()) parallelize_vocab(model, tp);
  tp::register_replicated(model, tp);  // what stays whole: embeddings, final norm, output head
}

}  // namespace models
}  // namespace fsdp
