// parallelize.cpp — the Megatron plan for the reference Transformer: which Linear layers are
// column- and which row-parallel, whether the embedding and head are split by vocabulary, and
// the layout record of every parameter, split or whole. Built from tp's layers; tp knows no model.
#include <fsdp/models/parallelize.h>

#include <fsdp/dtensor_parameter.h>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace models {
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
  TORCH_CHECK(!dynamic_cast<const tp::ColumnParallelLinearImpl*>(&module) &&
                  !dynamic_cast<const tp::RowParallelLinearImpl*>(&module) &&
                  !dynamic_cast<const tp::VocabParallelEmbeddingImpl*>(&module),
              "fsdp::models::parallelize: '", name, "' is already tensor-parallel; parallelize a model once");
}

template <typename ParallelImpl>
void replace_linear(torch::nn::Module& owner, const std::string& name, torch::nn::Linear& member,
                    const tp::TensorParallelMesh& tp) {
  check_whole(*member, name);
  member = owner.replace_module(
      name, torch::nn::Linear(std::shared_ptr<torch::nn::LinearImpl>(std::make_shared<ParallelImpl>(*member, tp))));
}

}  // namespace

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
  // The norms are whole on every tp rank.
  for (const auto& p : block.parameters()) {
    if (!dtensor_parameter(p))
      register_dtensor_parameter(p, tp.mesh(), std::vector<Placement>(tp.mesh().ndim(), Replicate()), p.sizes().vec());
  }
}

void parallelize_vocab(TransformerImpl& model, const tp::TensorParallelMesh& tp) {
  check_vocab_parallelizable(model.args().vocab_size, tp.size());
  const KeepGlobalGenerator keep;
  check_whole(*model.tok_embeddings, "tok_embeddings");
  model.tok_embeddings = model.replace_module(
      "tok_embeddings", torch::nn::Embedding(std::shared_ptr<torch::nn::EmbeddingImpl>(
                            std::make_shared<tp::VocabParallelEmbeddingImpl>(*model.tok_embeddings, tp))));
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
