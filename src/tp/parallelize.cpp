// The Megatron plan for the reference Transformer: which Linear layers are column- and which
// row-parallel, whether the embedding and head are split by vocabulary, and the layout record of
// every parameter, split or whole.
#include <fsdp/tensor_parallel.h>

#include <fsdp/dtensor_parameter.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace tp {
namespace {

// parallelize leaves the global generator as it found it: the layers it builds draw values that
// the full model's immediately replace.
struct KeepGlobalGenerator {
  KeepGlobalGenerator() : state(at::detail::getDefaultCPUGenerator().get_state()) {}
  ~KeepGlobalGenerator() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    gen.set_state(state);
  }
  at::Tensor state;
};

void check_whole(const torch::nn::Module& module, const std::string& name) {
  TORCH_CHECK(!dynamic_cast<const ColumnParallelLinearImpl*>(&module) &&
              !dynamic_cast<const RowParallelLinearImpl*>(&module) &&
              !dynamic_cast<const VocabParallelEmbeddingImpl*>(&module),
              "fsdp::tp::parallelize: '", name, "' is already tensor-parallel; parallelize a model once");
}

template <typename ParallelImpl>
void replace_linear(torch::nn::Module& owner, const std::string& name, torch::nn::Linear& member,
                    const TensorParallelMesh& tp) {
  check_whole(*member, name);
  member = owner.replace_module(name, torch::nn::Linear(std::shared_ptr<torch::nn::LinearImpl>(std::make_shared<ParallelImpl>(*member, tp))));
}

}  // namespace

void check_parallelizable(int64_t n_heads, int64_t dim, int64_t tp_size) {
  TORCH_CHECK(tp_size >= 1, "fsdp::tp: the tensor-parallel size must be >= 1, got ", tp_size);
  TORCH_CHECK(n_heads % tp_size == 0, "fsdp::tp: n_heads=", n_heads, " is not divisible by the tensor-parallel size ",
              tp_size, "; each tp rank computes whole heads, so choose a tp size that divides n_heads");
  TORCH_CHECK(dim % tp_size == 0, "fsdp::tp: dim=", dim, " is not divisible by the tensor-parallel size ", tp_size);
}

void check_vocab_parallelizable(int64_t vocab_size, int64_t tp_size) {
  TORCH_CHECK(tp_size >= 1, "fsdp::tp: the tensor-parallel size must be >= 1, got ", tp_size);
  TORCH_CHECK(vocab_size % tp_size == 0, "fsdp::tp: vocab_size=", vocab_size,
              " is not divisible by the tensor-parallel size ", tp_size, "; a vocab-parallel embedding and head "
              "give each tp rank vocab_size / tp rows, so choose a tp size that divides it, or keep them whole "
              "(ParallelizeOptions().vocab_parallel(false))");
}

void parallelize_block(models::TransformerBlockImpl& block, const models::ModelArgs& args,
                       const TensorParallelMesh& tp) {
  check_parallelizable(args.n_heads, args.dim, tp.size());
  const KeepGlobalGenerator keep;
  models::AttentionImpl& attention = *block.attention;
  replace_linear<ColumnParallelLinearImpl>(attention, "wq", attention.wq, tp);
  replace_linear<ColumnParallelLinearImpl>(attention, "wk", attention.wk, tp);
  replace_linear<ColumnParallelLinearImpl>(attention, "wv", attention.wv, tp);
  replace_linear<RowParallelLinearImpl>(attention, "wo", attention.wo, tp);
  models::FeedForwardImpl& ff = *block.feed_forward;
  replace_linear<ColumnParallelLinearImpl>(ff, "w1", ff.w1, tp);
  replace_linear<RowParallelLinearImpl>(ff, "w2", ff.w2, tp);
  // The norms are whole on every tp rank.
  for (const auto& p : block.parameters()) {
    if (!dtensor_parameter(p)) register_dtensor_parameter(p, tp.mesh(), std::vector<Placement>(tp.mesh().ndim(), Replicate()), p.sizes().vec());
  }
}

void parallelize_vocab(models::TransformerImpl& model, const TensorParallelMesh& tp) {
  check_vocab_parallelizable(model.args().vocab_size, tp.size());
  const KeepGlobalGenerator keep;
  check_whole(*model.tok_embeddings, "tok_embeddings");
  model.tok_embeddings = model.replace_module(
      "tok_embeddings", torch::nn::Embedding(std::shared_ptr<torch::nn::EmbeddingImpl>(
                            std::make_shared<VocabParallelEmbeddingImpl>(*model.tok_embeddings, tp))));
  // The head's rows are the vocabulary: column-parallel, its output this rank's logits.
  replace_linear<ColumnParallelLinearImpl>(model, "output", model.output, tp);
}

void register_replicated(torch::nn::Module& model, const TensorParallelMesh& tp) {
  const std::vector<Placement> whole(tp.mesh().ndim(), Replicate());
  for (const auto& p : model.parameters()) {
    // A block already sharded by fully_shard registers its shards here, whose unsharded
    // tensors carry the records; only parameters outside the blocks get one now.
    if (fsdp::is_sharded_parameter(p) || dtensor_parameter(p)) continue;
    register_dtensor_parameter(p, tp.mesh(), whole, p.sizes().vec());
  }
}

void parallelize(models::TransformerImpl& model, const TensorParallelMesh& tp, const ParallelizeOptions& options) {
  const models::ModelArgs& args = model.args();
  check_parallelizable(args.n_heads, args.dim, tp.size());
  if (options.vocab_parallel()) check_vocab_parallelizable(args.vocab_size, tp.size());
  for (auto& block : model.blocks()) parallelize_block(*block, args, tp);
  if (options.vocab_parallel()) parallelize_vocab(model, tp);
  register_replicated(model, tp);  // what stays whole: embeddings, final norm, output head
}

}  // namespace tp
}  // namespace fsdp
