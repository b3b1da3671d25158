// layer: tensor (what may include what: docs/architecture.md)
/// \file
/// fsdp/dtensor_parameter.h — marks a module's parameter as this rank's piece of a DTensor.
///
/// In PyTorch a tensor-parallel parameter *is* a DTensor; LibTorch modules hold plain tensors, so
/// the layer that splits a parameter (tensor parallelism, fsdp/tensor_parallel.h) records here
/// what the local tensor is a piece of: the mesh, one placement per mesh dim, the global shape.
/// fully_shard over a (dp, tp) mesh reads it (FullyShardOptions::dp_mesh_dims), and so does
/// anything that wants the whole parameter back:
///
/// \code{.cpp}
///   fsdp::register_dtensor_parameter(linear->weight, mesh, {fsdp::Shard(0)}, {out_features, in_features});
///   auto d = fsdp::dtensor_parameter(linear->weight);   // std::optional<DTensor>
///   at::Tensor whole = d->full_tensor();                  // collective over the mesh
/// \endcode
///
/// The record follows the tensor object (its TensorImpl), not its storage, and is forgotten when
/// the tensor is destroyed. Thread-safe.
#pragma once

#include <fsdp/dtensor.h>

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace fsdp {

/// Records that `param` is this rank's piece of a tensor of `global_shape` laid out over `mesh`
/// with `placements` (checked as DTensor::from_local checks them; throws c10::Error naming the
/// mismatch). A second call for the same tensor replaces the record. No communication.
void register_dtensor_parameter(const at::Tensor& param, const DeviceMesh& mesh, std::vector<Placement> placements,
                                std::vector<int64_t> global_shape);
/// The DTensor `param` is the local piece of (sharing its storage), or std::nullopt when nothing
/// was registered for it.
std::optional<DTensor> dtensor_parameter(const at::Tensor& param);

}  // namespace fsdp
