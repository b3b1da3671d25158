// layer: fsdp (what may include what: docs/architecture.md)
/// \file
/// fsdp/dp_mesh_dims.h — DataParallelMeshDims: which dims of a fully_shard mesh are
/// data-parallel when the mesh also has the model's own dims (tensor parallelism).
#pragma once

#include <torch/arg.h>

#include <string>

namespace fsdp {

/// Which dims of FullyShardOptions::mesh are data-parallel, when the mesh also has model dims
/// (PyTorch's DataParallelMeshDims): FSDP over tensor parallelism.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {dp, tp}, {"dp", "tp"});
///   fsdp::models::parallelize(model, fsdp::tp::TensorParallelMesh(mesh, "tp"));   // fsdp/models/parallelize.h
///   auto options = fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(fsdp::DataParallelMeshDims().shard("dp"));
///   for (auto& block : model->blocks()) fsdp::fully_shard(block, options);
///   fsdp::fully_shard(model, options);
/// \endcode
///
/// Every parameter must then be the local piece of a DTensor on that same mesh object
/// (fsdp/dtensor_parameter.h; parallelize registers them) with Replicate() on the dp dim. FSDP
/// shards each local piece along dim 0 (or the shard_placement_fn dim) over the `shard` dim
/// only: the all-gathers and reduce-scatters run on the dp dim's group, and gradients are
/// averaged over it; the model dims' collectives stay in the model's layers. as_dtensor then
/// gives the parameter on the whole mesh: its own placements with the dp entry Shard(d), or
/// StridedShard(d, k) when a later mesh dim already splits d into k pieces (column-parallel
/// weights on a (dp, tp) mesh: (StridedShard(0, tp), Shard(0))), and its global shape.
/// `replicate` (HSDP with model dims) is not supported yet and throws; both empty throws.
/// An int reshard_after_forward with dp_mesh_dims throws, as in PyTorch.
struct DataParallelMeshDims {
  /// The mesh dim FSDP shards over.
  TORCH_ARG(std::string, shard);
  /// The mesh dim HSDP replicates over (not supported yet).
  TORCH_ARG(std::string, replicate);
};

}  // namespace fsdp
