// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/mixed_precision.h — MixedPrecisionPolicy: which dtypes one fully_shard group computes,
/// communicates and returns in, while its sharded parameters keep their own dtype.
///
/// \code{.cpp}
///   auto bf16 = fsdp::MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(torch::kFloat32);
///   for (auto& block : model->blocks) fsdp::fully_shard(block, fsdp::FullyShardOptions().mp_policy(bf16));
///   fsdp::fully_shard(model, fsdp::FullyShardOptions().mp_policy(bf16));
/// \endcode
///
/// With a policy (PyTorch FSDP2's semantics):
///  - The sharded parameters (parameters(), the optimizer, state dicts, checkpoints) keep the dtype
///    they had at fully_shard: fp32 master weights stay fp32.
///  - param_dtype: each unshard casts this rank's shard into the all-gather input (bf16 halves the
///    bytes), and the unsharded parameters the module computes with (linear->weight) are of this
///    dtype while the module is unsharded; so are the gradients autograd produces for them.
///  - reduce_dtype: the reduce-scatter runs in it (unset: in param_dtype, i.e. the gradients'
///    dtype); its output is cast to the sharded parameters' dtype. Under
///    set_requires_gradient_sync(false) the unsharded gradients accumulate in reduce_dtype when it
///    differs from param_dtype (e.g. fp32 accumulation of bf16 micro-batch gradients).
///  - cast_forward_inputs (default true): before the module's forward, floating-point tensor
///    arguments are cast to param_dtype (nothing happens when param_dtype is unset).
///  - output_dtype: after the module's forward, floating-point tensor outputs are cast to it. Use it
///    at the boundary between modules with different policies (e.g. bf16 blocks before an fp32
///    final norm and output head).
///  - Integer and bool parameters are never cast; buffers are never cast.
///  - A dtype equal to the parameters' own dtype is the same as leaving it unset.
///
/// Each fully_shard call takes its own policy. On a CPU mesh, float16 compute needs LibTorch's fp16
/// CPU kernels (LibTorch 2.x has them): fully_shard checks once and refuses, suggesting bfloat16,
/// on a LibTorch built without them.
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <optional>
#include <string>

namespace fsdp {

/// FSDP2's MixedPrecisionPolicy: the dtypes a group computes, reduces and returns in
/// (FullyShardOptions::mp_policy).
struct MixedPrecisionPolicy {
  /// Dtype of the unsharded parameters (all-gather, forward and backward compute). Unset: the
  /// parameters' own dtype.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// Dtype of the gradient reduction. Unset: param_dtype (the gradients' dtype).
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// Dtype floating-point forward outputs are cast to. Unset: no cast.
  TORCH_ARG(std::optional<at::ScalarType>, output_dtype) = std::nullopt;
  /// Whether floating-point forward inputs are cast to param_dtype.
  TORCH_ARG(bool, cast_forward_inputs) = true;

 public:
  /// "MixedPrecisionPolicy(param_dtype=BFloat16, reduce_dtype=Float, output_dtype=None,
  /// cast_forward_inputs=true)", for logs and errors.
  std::string str() const;
};

}  // namespace fsdp
