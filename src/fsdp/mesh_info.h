// mesh_info.h — which dims of a fully_shard mesh shard and which replicate: a 1-D mesh shards
// over its one dim (FSDP); a 2-D mesh (HSDP) replicates over dim 0 and shards over dim 1; a mesh
// given with dp_mesh_dims (FSDP over tensor parallelism) shards over the named dp dim, and its
// other dims belong to the model (the parameters are already split or copied over them). The
// one place that reads a mesh's shape for FSDP; everything else asks this record.
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/dp_mesh_dims.h>
#include <fsdp/placement.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace fsdp {

namespace detail {

struct MeshInfo {
  DeviceMesh mesh;
  int64_t shard_dim = 0;       // the mesh dim parameters are split over (the last, or the named dp dim)
  int64_t replicate_dim = -1;  // HSDP: 0; -1 without a replicate dim
  // With dp_mesh_dims: the mesh dims that are not data-parallel (e.g. tp), in mesh order. The
  // parameters' own DTensor layouts (fsdp/dtensor_parameter.h) say what they hold there.
  std::vector<int64_t> model_dims;

  bool is_hsdp() const { return replicate_dim >= 0; }
  // True for a mesh given with dp_mesh_dims.
  bool has_model_dims() const { return !model_dims.empty(); }
  int64_t shard_size() const { return mesh.size(shard_dim); }
  int64_t shard_rank() const { return mesh.get_local_rank(shard_dim); }
  // 1 without HSDP.
  int64_t replicate_size() const { return is_hsdp() ? mesh.size(replicate_dim) : 1; }
  std::shared_ptr<ProcessGroup> shard_group() const { return mesh.get_group(shard_dim); }
  // Null without HSDP.
  std::shared_ptr<ProcessGroup> replicate_group() const { return is_hsdp() ? mesh.get_group(replicate_dim) : nullptr; }
  // The DTensor placements of a parameter sharded along tensor dim `tensor_dim`: (Shard(d)), or
  // under HSDP (Replicate(), Shard(d)). With model dims, `model_placements` (the parameter's
  // layout before FSDP, Replicate() on the dp dim) with the dp dim's entry replaced by Shard(d),
  // or by StridedShard(d, k) when later mesh dims already split d into k pieces (FSDP then
  // splits each of their pieces, so their split applies first).
  std::vector<Placement> placements(int64_t tensor_dim = 0) const;
  std::vector<Placement> placements(int64_t tensor_dim, const std::vector<Placement>& model_placements) const;
};

// The record of a mesh fully_shard accepts: 1-D, or 2-D with dim names (HSDP), or, with
// dp_mesh_dims, any named mesh whose dp dim it names. Throws c10::Error saying what to pass
// for any other mesh.
MeshInfo mesh_info_of(const DeviceMesh& mesh, const std::optional<DataParallelMeshDims>& dp_mesh_dims = std::nullopt);

// The mesh record of the FSDP group that shards `param` (the registered shard or the module's
// member). Throws c10::Error when fully_shard does not manage it. (fully_shard.cpp)
MeshInfo mesh_info_of_parameter(const at::Tensor& param);

}  // namespace detail
}  // namespace fsdp
