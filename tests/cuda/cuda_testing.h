// cuda_testing.h — what the CUDA tests share: the skip without a GPU (with the reason), the GPU,
// ranks sharing it through Gloo, and the tiny Transformer they train, whole or sharded.
#pragma once

#include "harness/multiprocess.h"

#include <fsdp/device.h>
#include <fsdp/fully_shard.h>
#include <fsdp/models/transformer.h>

#include <gtest/gtest.h>
#include <torch/utils.h>

#define SKIP_WITHOUT_GPU()                                                                                \
  do {                                                                                                    \
    if (!fsdp::cuda_available()) GTEST_SKIP() << "needs a CUDA GPU: " << fsdp::cuda_unavailable_reason(); \
  } while (0)

namespace fsdp {
namespace testing {

inline const c10::Device kGpu(c10::DeviceType::CUDA, 0);

// Several ranks on the one GPU: NCCL refuses them, so the cuda mesh's groups run on Gloo.
inline DistOptions staged_through_host() {
  DistOptions o;
  o.env["FSDP_CUDA_BACKEND"] = "gloo";
  return o;
}

inline models::Transformer tiny_transformer() {
  torch::manual_seed(0);
  models::ModelArgs args;
  args.dropout_p = 0.0;
  return models::Transformer(args);
}

// The tiny Transformer with each block and the root sharded over `mesh`.
inline models::Transformer sharded(const DeviceMesh& mesh, FullyShardOptions opts = {}) {
  auto model = tiny_transformer();
  opts.mesh(mesh);
  for (auto& block : model->blocks()) fully_shard(block, opts);
  fully_shard(model, opts);
  return model;
}

}  // namespace testing
}  // namespace fsdp
