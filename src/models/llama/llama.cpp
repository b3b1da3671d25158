// The Llama family's decoder of fsdp/models/llama.h. Every submodule is called through
// fsdp::call (or tp's calls), so that any of them may be fully_shard()ed or split over tp. The
// arithmetic follows transformers' modeling_llama.py where rounding could differ: the rotary
// table in float32, RMSNorm in float32, the key/value heads repeated for consecutive query heads.
#include <fsdp/models/llama.h>

#include <fsdp/call.h>
#include <fsdp/tensor_parallel.h>

#include "src/models/tied_head.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <utility>

namespace fsdp {
namespace models {
namespace {

// x's halves swapped, the first negated: (-x2, x1), the rotation's partner of (x1, x2).
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::nn::Linear make_linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// transformers' _init_weights for a Linear layer: N(0, std^2) weight, zero bias.
void init_linear(torch::nn::LinearImpl& linear, double std) {
  at::NoGradGuard no_grad;
  linear.weight.normal_(0.0, std);
  if (linear.bias.defined()) linear.bias.zero_();
}
}  // namespace

void LlamaArgs::check() const {
  auto positive = [](int64_t v, const char* name) {
    TORCH_CHECK(v > 0, "fsdp::models::Llama: ", name, "=", v, " must be positive");
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(max_position_embeddings, "max_position_embeddings");
  TORCH_CHECK(num_attention_heads % num_key_value_heads == 0,
              "fsdp::models::Llama: num_attention_heads=", num_attention_heads,
              " is not a multiple of num_key_value_heads=", num_key_value_heads,
              "; each key/value head serves a whole number of query heads");
  TORCH_CHECK(head_dim % 2 == 0, "fsdp::models::Llama: head_dim=", head_dim,
              " must be even (the rotary embeddings rotate pairs of features)");
  TORCH_CHECK(rope.type == "default" || rope.type == "llama3", "fsdp::models::Llama: rope type '", rope.type,
              "' is not supported; use \"default\" or \"llama3\"");
  TORCH_CHECK(initializer_range >= 0, "fsdp::models::Llama: initializer_range=", initializer_range, " must be >= 0");
  TORCH_CHECK(rms_norm_eps > 0, "fsdp::models::Llama: rms_norm_eps=", rms_norm_eps, " must be positive");
}

void LlamaArgs::check_sequence_length(int64_t seq_len) const {
  TORCH_CHECK(sliding_window == 0 || seq_len <= sliding_window, "sliding_window is ", sliding_window,
              ", shorter than the sequence length ", seq_len,
              "; sliding-window attention is not computed here, so use a sequence no longer than the window");
}

at::Tensor rope_inverse_frequencies(const RopeArgs& rope, int64_t head_dim) {
  const at::Tensor exponents = at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(rope.theta, exponents);
  if (rope.type == "default") return inv_freq;
  // llama3: wavelengths longer than the original context / low_freq_factor are divided by
  // factor, those shorter than original / high_freq_factor kept, the band between interpolated.
  const double old_context = static_cast<double>(rope.original_max_position_embeddings);
  const double low_wavelen = old_context / rope.low_freq_factor;
  const double high_wavelen = old_context / rope.high_freq_factor;
  const at::Tensor wavelen = 2 * M_PI / inv_freq;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq);
  const at::Tensor smooth =
      (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled;
  const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor LlamaRMSNormImpl::forward(const at::Tensor& x) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * normed.to(x.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaArgs& args)
    : head_dim_(args.head_dim), groups_(args.num_attention_heads / args.num_key_value_heads) {
  const int64_t q = args.num_attention_heads * args.head_dim, kv = args.num_key_value_heads * args.head_dim;
  q_proj = register_module("q_proj", make_linear(args.hidden_size, q, args.attention_bias));
  k_proj = register_module("k_proj", make_linear(args.hidden_size, kv, args.attention_bias));
  v_proj = register_module("v_proj", make_linear(args.hidden_size, kv, args.attention_bias));
  o_proj = register_module("o_proj", make_linear(q, args.hidden_size, false));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t bsz = x.size(0), seq = x.size(1);
  // Under tensor parallelism the projections give this rank's heads only (whole key/value
  // heads and their query heads), hence -1.
  auto heads = [&](const at::Tensor& t) { return t.view({bsz, seq, -1, head_dim_}).transpose(1, 2); };
  const std::vector<at::Tensor> qkv = tp::call_linears_on_shared_input({q_proj, k_proj, v_proj}, x);
  at::Tensor q = heads(qkv[0]);
  at::Tensor k = heads(qkv[1]);
  at::Tensor v = heads(qkv[2]);
  const at::Tensor c = cos.to(q.scalar_type()), s = sin.to(q.scalar_type());
  q = q * c + rotate_half(q) * s;
  k = k * c + rotate_half(k) * s;
  if (groups_ > 1) {
    // Key/value head j serves query heads j*groups .. (j+1)*groups-1: each repeated in place.
    k = k.repeat_interleave(groups_, 1);
    v = v.repeat_interleave(groups_, 1);
  }
  const at::Tensor out = at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0,
                                                          /*is_causal=*/true);
  return tp::call_linear(o_proj, out.transpose(1, 2).contiguous().view({bsz, seq, -1}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaArgs& args) {
  gate_proj = register_module("gate_proj", make_linear(args.hidden_size, args.intermediate_size, false));
  up_proj = register_module("up_proj", make_linear(args.hidden_size, args.intermediate_size, false));
  down_proj = register_module("down_proj", make_linear(args.intermediate_size, args.hidden_size, false));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  const std::vector<at::Tensor> gate_up = tp::call_linears_on_shared_input({gate_proj, up_proj}, x);
  return tp::call_linear(down_proj, at::silu(gate_up[0]) * gate_up[1]);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaArgs& args) {
  self_attn = register_module("self_attn", LlamaAttention(args));
  mlp = register_module("mlp", LlamaMLP(args));
  input_layernorm = register_module("input_layernorm", LlamaRMSNorm(args.hidden_size, args.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", LlamaRMSNorm(args.hidden_size, args.rms_norm_eps));
  for (torch::nn::Linear* l : {&self_attn->q_proj, &self_attn->k_proj, &self_attn->v_proj, &self_attn->o_proj,
                               &mlp->gate_proj, &mlp->up_proj, &mlp->down_proj})
    init_linear(**l, args.initializer_range);
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor h = x + fsdp::call(self_attn, fsdp::call(input_layernorm, x), cos, sin);
  return h + fsdp::call(mlp, fsdp::call(post_attention_layernorm, h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaArgs& args, const std::function<void(LlamaDecoderLayer&)>& on_layer_built) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(args.vocab_size, args.hidden_size));
  {
    at::NoGradGuard no_grad;
    embed_tokens->weight.normal_(0.0, args.initializer_range);
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < args.num_hidden_layers; ++i) {
    decoder_layers.push_back(LlamaDecoderLayer(args));
    layers->push_back(decoder_layers.back());
    if (on_layer_built) on_layer_built(decoder_layers.back());
  }
  norm = register_module("norm", LlamaRMSNorm(args.hidden_size, args.rms_norm_eps));
}

LlamaImpl::LlamaImpl(const LlamaArgs& args, const LlamaLayerBuiltHook& on_layer_built) : args_(args) {
  args_.check();
  model = register_module("model", LlamaModel(args_, on_layer_built));
  if (args_.tie_word_embeddings) {
    lm_head = register_module("lm_head", tied_head::make(model->embed_tokens->weight));
  } else {
    lm_head = register_module("lm_head", make_linear(args_.hidden_size, args_.vocab_size, false));
    init_linear(*lm_head, args_.initializer_range);
  }
  inv_freq_ = rope_inverse_frequencies(args_.rope, args_.head_dim);
}

std::vector<std::shared_ptr<torch::nn::Module>> LlamaImpl::decoder_layer_modules() {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (auto& layer : model->decoder_layers) out.push_back(layer.ptr());
  return out;
}

std::pair<at::Tensor, at::Tensor> LlamaImpl::rotary(int64_t seq, const at::Device& device) {
  if (inv_freq_.device() != device) inv_freq_ = inv_freq_.to(device);
  const at::Tensor positions = at::arange(seq, inv_freq_.options());
  const at::Tensor freqs = at::outer(positions, inv_freq_);  // [seq, head_dim / 2]
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {angles.cos(), angles.sin()};
}

at::Tensor LlamaImpl::normed_hidden_states(const at::Tensor& tokens) {
  const int64_t seq = tokens.size(1);
  TORCH_CHECK(seq <= args_.max_position_embeddings, "fsdp::models::Llama: sequence length ", seq,
              " > max_position_embeddings ", args_.max_position_embeddings);
  at::Tensor h = tp::call_embedding(model->embed_tokens, tokens);
  const auto [cos, sin] = rotary(seq, h.device());
  std::vector<LlamaDecoderLayer>& layers = model->decoder_layers;
  for (size_t i = 0; i < layers.size(); ++i) h = call_layer(static_cast<int64_t>(i), layers[i], h, cos, sin);
  return fsdp::call(model->norm, h);
}

}  // namespace models
}  // namespace fsdp
