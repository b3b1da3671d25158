// GPT-2 of fsdp/models/gpt2.h. Every submodule is called through fsdp::call, so that any of them
// may be fully_shard()ed. The arithmetic follows transformers' modeling_gpt2.py where rounding
// could differ: Conv1D as one addmm of the bias, the rows and the [in, out] weight; the scores
// scaled before the softmax.
#include <fsdp/models/gpt2.h>

#include <fsdp/call.h>
#include <fsdp/tensor_parallel.h>

#include "src/models/tied_head.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace fsdp {
namespace models {
namespace {

torch::nn::LayerNorm make_layer_norm(const Gpt2Args& args) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({args.n_embd}).eps(args.layer_norm_epsilon));
}

// transformers' _init_weights for a Conv1D: N(0, std^2) weight, zero bias.
void init_conv1d(Gpt2Conv1DImpl& conv, double std) {
  at::NoGradGuard no_grad;
  conv.weight.normal_(0.0, std);
  conv.bias.zero_();
}

at::Tensor dropout_in_training(const at::Tensor& x, double p, bool training) {
  return training && p > 0 ? at::dropout(x, p, /*train=*/true) : x;
}

}  // namespace

void Gpt2Args::check() const {
  auto positive = [](int64_t v, const char* name) {
    TORCH_CHECK(v > 0, "fsdp::models::Gpt2: ", name, "=", v, " must be positive");
  };
  positive(vocab_size, "vocab_size");
  positive(n_positions, "n_positions");
  positive(n_embd, "n_embd");
  positive(n_layer, "n_layer");
  positive(n_head, "n_head");
  positive(n_inner, "n_inner");
  TORCH_CHECK(n_embd % n_head == 0, "fsdp::models::Gpt2: n_embd=", n_embd, " is not a multiple of n_head=", n_head,
              "; each head takes n_embd / n_head features");
  for (const auto& [p, name] : {std::pair<double, const char*>{embd_pdrop, "embd_pdrop"},
                                {attn_pdrop, "attn_pdrop"},
                                {resid_pdrop, "resid_pdrop"}})
    TORCH_CHECK(p >= 0 && p < 1, "fsdp::models::Gpt2: ", name, "=", p, " must be in [0, 1)");
  TORCH_CHECK(
      activation_function == "gelu_new" || activation_function == "gelu_pytorch_tanh" || activation_function == "gelu",
      "fsdp::models::Gpt2: activation_function '", activation_function,
      "' is not computed here; use gelu_new, gelu_pytorch_tanh or gelu");
  TORCH_CHECK(layer_norm_epsilon > 0, "fsdp::models::Gpt2: layer_norm_epsilon=", layer_norm_epsilon,
              " must be positive");
  TORCH_CHECK(initializer_range >= 0, "fsdp::models::Gpt2: initializer_range=", initializer_range, " must be >= 0");
}

Gpt2Conv1DImpl::Gpt2Conv1DImpl(int64_t in, int64_t out) {
  weight = register_parameter("weight", at::empty({in, out}));
  bias = register_parameter("bias", at::zeros({out}));
}

at::Tensor Gpt2Conv1DImpl::forward(const at::Tensor& x) {
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = weight.size(1);
  return at::addmm(bias, x.reshape({-1, x.size(-1)}), weight).view(out_shape);
}

Gpt2AttentionImpl::Gpt2AttentionImpl(const Gpt2Args& args)
    : n_head_(args.n_head),
      scale_(args.scale_attn_weights ? 1.0 / std::sqrt(static_cast<double>(args.n_embd / args.n_head)) : 1.0),
      attn_pdrop_(args.attn_pdrop),
      resid_pdrop_(args.resid_pdrop) {
  c_attn = register_module("c_attn", Gpt2Conv1D(args.n_embd, 3 * args.n_embd));
  c_proj = register_module("c_proj", Gpt2Conv1D(args.n_embd, args.n_embd));
}

at::Tensor Gpt2AttentionImpl::forward(const at::Tensor& x) {
  const int64_t bsz = x.size(0), seq = x.size(1), dim = x.size(2);
  const std::vector<at::Tensor> qkv = fsdp::call(c_attn, x).split(dim, /*dim=*/2);
  auto heads = [&](const at::Tensor& t) { return t.view({bsz, seq, n_head_, dim / n_head_}).transpose(1, 2); };
  const at::Tensor out = at::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]),
                                                          /*attn_mask=*/std::nullopt,
                                                          /*dropout_p=*/is_training() ? attn_pdrop_ : 0.0,
                                                          /*is_causal=*/true, /*scale=*/scale_);
  const at::Tensor projected = fsdp::call(c_proj, out.transpose(1, 2).contiguous().view({bsz, seq, dim}));
  return dropout_in_training(projected, resid_pdrop_, is_training());
}

Gpt2MLPImpl::Gpt2MLPImpl(const Gpt2Args& args) : activation_(args.activation_function), resid_pdrop_(args.resid_pdrop) {
  c_fc = register_module("c_fc", Gpt2Conv1D(args.n_embd, args.n_inner));
  c_proj = register_module("c_proj", Gpt2Conv1D(args.n_inner, args.n_embd));
}

at::Tensor Gpt2MLPImpl::forward(const at::Tensor& x) {
  const at::Tensor h = fsdp::call(c_fc, x);
  const at::Tensor activated = at::gelu(h, activation_ == "gelu" ? "none" : "tanh");
  return dropout_in_training(fsdp::call(c_proj, activated), resid_pdrop_, is_training());
}

Gpt2BlockImpl::Gpt2BlockImpl(const Gpt2Args& args) {
  ln_1 = register_module("ln_1", make_layer_norm(args));
  attn = register_module("attn", Gpt2Attention(args));
  ln_2 = register_module("ln_2", make_layer_norm(args));
  mlp = register_module("mlp", Gpt2MLP(args));
  const double residual_std = args.initializer_range / std::sqrt(2.0 * static_cast<double>(args.n_layer));
  init_conv1d(*attn->c_attn, args.initializer_range);
  init_conv1d(*attn->c_proj, residual_std);
  init_conv1d(*mlp->c_fc, args.initializer_range);
  init_conv1d(*mlp->c_proj, residual_std);
}

at::Tensor Gpt2BlockImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x + fsdp::call(attn, fsdp::call(ln_1, x));
  return h + fsdp::call(mlp, fsdp::call(ln_2, h));
}

Gpt2ModelImpl::Gpt2ModelImpl(const Gpt2Args& args, const std::function<void(Gpt2Block&)>& on_block_built) {
  wte = register_module("wte", torch::nn::Embedding(args.vocab_size, args.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(args.n_positions, args.n_embd));
  {
    at::NoGradGuard no_grad;
    wte->weight.normal_(0.0, args.initializer_range);
    wpe->weight.normal_(0.0, args.initializer_range);
  }
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < args.n_layer; ++i) {
    blocks.push_back(Gpt2Block(args));
    h->push_back(blocks.back());
    if (on_block_built) on_block_built(blocks.back());
  }
  ln_f = register_module("ln_f", make_layer_norm(args));
}

Gpt2Impl::Gpt2Impl(const Gpt2Args& args, const Gpt2BlockBuiltHook& on_block_built) : args_(args) {
  args_.check();
  transformer = register_module("transformer", Gpt2Model(args_, on_block_built));
  if (args_.tie_word_embeddings) {
    lm_head = register_module("lm_head", tied_head::make(transformer->wte->weight));
  } else {
    lm_head = register_module("lm_head",
                              torch::nn::Linear(torch::nn::LinearOptions(args_.n_embd, args_.vocab_size).bias(false)));
    at::NoGradGuard no_grad;
    lm_head->weight.normal_(0.0, args_.initializer_range);
  }
}

std::vector<std::shared_ptr<torch::nn::Module>> Gpt2Impl::decoder_layer_modules() {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (auto& block : transformer->blocks) out.push_back(block.ptr());
  return out;
}

at::Tensor Gpt2Impl::normed_hidden_states(const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= args_.n_positions, "fsdp::models::Gpt2: sequence length ", seq, " > n_positions ",
              args_.n_positions, " (the rows of wpe)");
  const at::Tensor positions = at::arange(seq, tokens.options().dtype(at::kLong));
  at::Tensor h = tp::call_embedding(transformer->wte, tokens) + fsdp::call(transformer->wpe, positions);
  h = dropout_in_training(h, args_.embd_pdrop, is_training());
  std::vector<Gpt2Block>& blocks = transformer->blocks;
  for (size_t i = 0; i < blocks.size(); ++i) h = call_layer(static_cast<int64_t>(i), blocks[i], h);
  return fsdp::call(transformer->ln_f, h);
}

}  // namespace models
}  // namespace fsdp
