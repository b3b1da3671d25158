// The Transformer of fsdp/models/transformer.h. Every submodule is called through fsdp::call, so
// that any of them may be fully_shard()ed.
#include <fsdp/models/transformer.h>

#include <fsdp/call.h>
#include <fsdp/fully_shard.h>
#include <fsdp/tensor_parallel.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace fsdp {
namespace models {

ModelArgs ModelArgs::preset(const std::string& name) {
  ModelArgs a;
  if (name == "tiny") return a;
  if (name == "small") {
    a.n_layers = 4, a.dim = 256, a.n_heads = 8, a.vocab_size = 8192, a.max_seq_len = 256;
    return a;
  }
  if (name == "medium") {
    a.n_layers = 8, a.dim = 768, a.n_heads = 12, a.vocab_size = 32000, a.max_seq_len = 512;
    return a;
  }
  TORCH_CHECK(false, "unknown model preset '", name, "'; choose tiny, small or medium");
}

std::vector<std::string> ModelArgs::preset_names() { return {"tiny", "small", "medium"}; }

AttentionImpl::AttentionImpl(const ModelArgs& args)
    : n_heads_(args.n_heads), head_dim_(args.dim / args.n_heads), dropout_p_(args.dropout_p) {
  TORCH_CHECK(args.dim % args.n_heads == 0, "dim=", args.dim, " is not divisible by n_heads=", args.n_heads);
  auto linear = [&] { return torch::nn::Linear(torch::nn::LinearOptions(args.dim, args.dim).bias(false)); };
  wq = register_module("wq", linear());
  wk = register_module("wk", linear());
  wv = register_module("wv", linear());
  wo = register_module("wo", linear());
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(args.dropout_p));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  const int64_t bsz = x.size(0), seq = x.size(1);
  // The heads this rank computes: all n_heads, or n_heads / tp under tensor parallelism (wq, wk
  // and wv then produce only this rank's heads' features, and share one all-reduce of x's
  // gradient).
  auto heads = [&](const at::Tensor& t) { return t.view({bsz, seq, -1, head_dim_}).transpose(1, 2); };
  const std::vector<at::Tensor> qkv = tp::call_linears_on_shared_input({wq, wk, wv}, x);
  at::Tensor q = heads(qkv[0]);
  at::Tensor k = heads(qkv[1]);
  at::Tensor v = heads(qkv[2]);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(head_dim_)));
  at::Tensor future = at::ones({seq, seq}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  at::Tensor probs = at::softmax(scores, -1);
  if (is_training() && dropout_p_ > 0) probs = at::dropout(probs, dropout_p_, /*train=*/true);
  at::Tensor out = at::matmul(probs, v).transpose(1, 2).contiguous().view({bsz, seq, -1});
  return fsdp::call(resid_dropout, tp::call_linear(wo, out));
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden_dim, double dropout_p) {
  w1 = register_module("w1", torch::nn::Linear(dim, hidden_dim));
  w2 = register_module("w2", torch::nn::Linear(hidden_dim, dim));
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(dropout_p));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) {
  return fsdp::call(resid_dropout, tp::call_linear(w2, at::gelu(tp::call_linear(w1, x))));
}

TransformerBlockImpl::TransformerBlockImpl(const ModelArgs& args) {
  attention_norm = register_module("attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({args.dim})));
  attention = register_module("attention", Attention(args));
  ffn_norm = register_module("ffn_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({args.dim})));
  feed_forward = register_module("feed_forward", FeedForward(args.dim, 4 * args.dim, args.dropout_p));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + fsdp::call(attention, fsdp::call(attention_norm, x));
  return h + fsdp::call(feed_forward, fsdp::call(ffn_norm, h));
}

TransformerImpl::TransformerImpl(const ModelArgs& args, const BlockBuiltHook& on_block_built) : args_(args) {
  tok_embeddings = register_module("tok_embeddings", torch::nn::Embedding(args.vocab_size, args.dim));
  pos_embeddings = register_module("pos_embeddings", torch::nn::Embedding(args.max_seq_len, args.dim));
  dropout = register_module("dropout", torch::nn::Dropout(args.dropout_p));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < args.n_layers; ++i) {
    blocks_.push_back(TransformerBlock(args));
    layers->push_back(blocks_.back());
    // Before the next block exists: a hook that shards this one frees its full parameters now.
    if (on_block_built) on_block_built(blocks_.back());
  }
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({args.dim})));
  output =
      register_module("output", torch::nn::Linear(torch::nn::LinearOptions(args.dim, args.vocab_size).bias(false)));
}

at::Tensor TransformerImpl::normed_hidden_states(const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= args_.max_seq_len, "sequence length ", seq, " > max_seq_len ", args_.max_seq_len);
  at::Tensor pos = at::arange(seq, tokens.options().dtype(at::kLong));
  at::Tensor h = fsdp::call(dropout, tp::call_embedding(tok_embeddings, tokens) + fsdp::call(pos_embeddings, pos));
  for (size_t i = 0; i < blocks_.size(); ++i) h = call_layer(static_cast<int64_t>(i), blocks_[i], h);
  return fsdp::call(norm, h);
}

std::vector<std::shared_ptr<torch::nn::Module>> TransformerImpl::decoder_layer_modules() {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (auto& block : blocks_) out.push_back(block.ptr());
  return out;
}

Transformer sharded_transformer(const ModelArgs& args, const FullyShardOptions& block_options,
                                const FullyShardOptions& root_options) {
  Transformer model(args, [&](TransformerBlock& block) { fully_shard(block, block_options); });
  fully_shard(model, root_options);
  return model;
}

Transformer sharded_transformer(const ModelArgs& args, const FullyShardOptions& block_options,
                                const FullyShardOptions& head_options, const FullyShardOptions& root_options) {
  Transformer model(args, [&](TransformerBlock& block) { fully_shard(block, block_options); });
  fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->norm.ptr(), model->output.ptr()}, head_options);
  fully_shard(model, root_options);
  return model;
}

int64_t count_parameters(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

}  // namespace models
}  // namespace fsdp
