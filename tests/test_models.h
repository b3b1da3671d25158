// test_models.h — small models shared by several test files.
#pragma once

#include <fsdp/call.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <ATen/ATen.h>

namespace fsdp {
namespace testing {

// The tiny Transformer (dropout 0) plus a buffer, so that state dicts carry both kinds of entry.
struct WithBufferImpl : torch::nn::Module {
  explicit WithBufferImpl(uint64_t seed) {
    torch::manual_seed(seed);
    fsdp::models::ModelArgs args;
    args.dropout_p = 0.0;
    net = register_module("net", fsdp::models::Transformer(args));
    scale = register_buffer("scale", at::full({3}, static_cast<double>(seed)));
  }
  at::Tensor forward(const at::Tensor& tokens) { return fsdp::call(net, tokens) * scale[0]; }
  fsdp::models::Transformer net{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(WithBuffer);

// A WithBuffer with fully_shard on each block, then on the whole (default mesh).
inline WithBuffer make_sharded(uint64_t seed) {
  WithBuffer m(seed);
  for (auto& block : m->net->blocks()) fsdp::fully_shard(block);
  fsdp::fully_shard(m);
  return m;
}

}  // namespace testing
}  // namespace fsdp
