// mesh_info.cpp — the meshes fully_shard accepts and what each of their dims does.
#include "src/fsdp/mesh_info.h"

#include <c10/util/Exception.h>

namespace fsdp {
namespace detail {
namespace {

MeshInfo spmd_mesh_info(const DeviceMesh& mesh, const DataParallelMeshDims& dims) {
  TORCH_CHECK(!dims.shard().empty() || !dims.replicate().empty(),
              "fully_shard: DataParallelMeshDims needs at "
              "least one of shard or replicate; e.g. DataParallelMeshDims().shard(\"dp\")");
  TORCH_CHECK(dims.replicate().empty(),
              "fully_shard: DataParallelMeshDims.replicate (HSDP over a mesh with model "
              "dims) is not supported yet; pass only shard (the dp dim FSDP shards over)");
  TORCH_CHECK(!mesh.dim_names().empty(), "fully_shard: dp_mesh_dims names mesh dims, but the mesh ", mesh.str(),
              " has no dim names; build it with e.g. fsdp::init_device_mesh(\"cpu\", {dp, tp}, {\"dp\", \"tp\"})");
  MeshInfo info{mesh, mesh.dim_index(dims.shard()), -1, {}};
  for (int64_t d = 0; d < mesh.ndim(); ++d) {
    if (d != info.shard_dim) info.model_dims.push_back(d);
  }
  return info;
}

}  // namespace

std::vector<Placement> MeshInfo::placements(int64_t tensor_dim) const {
  if (is_hsdp()) return {Replicate(), Shard(tensor_dim)};
  return {Shard(tensor_dim)};
}

std::vector<Placement> MeshInfo::placements(int64_t tensor_dim, const std::vector<Placement>& model_placements) const {
  if (!has_model_dims()) return placements(tensor_dim);
  std::vector<Placement> out = model_placements;
  int64_t split_after = 1;
  for (int64_t j = shard_dim + 1; j < mesh.ndim(); ++j) {
    if (out[j].is_shard(tensor_dim)) split_after *= mesh.size(j);
  }
  out[shard_dim] = split_after > 1 ? StridedShard(tensor_dim, split_after) : Shard(tensor_dim);
  return out;
}

MeshInfo mesh_info_of(const DeviceMesh& mesh, const std::optional<DataParallelMeshDims>& dp_mesh_dims) {
  TORCH_CHECK(mesh.valid(), "fully_shard: the mesh handle is empty; build one with fsdp::init_device_mesh()");
  if (dp_mesh_dims) return spmd_mesh_info(mesh, *dp_mesh_dims);
  const int64_t ndim = mesh.ndim();
  TORCH_CHECK(ndim == 1 || ndim == 2, "fully_shard expects a 1-D or 2-D DeviceMesh but got ", mesh.str(),
              "; pass a 1-D mesh (FSDP) or a 2-D mesh with dim names (replicate, shard) for HSDP");
  if (ndim == 1) return MeshInfo{mesh, 0, -1, {}};
  TORCH_CHECK(!mesh.dim_names().empty(),
              "fully_shard: please init the 2-D mesh for HSDP with mesh_dim_names "
              "specified, got ",
              mesh.str(),
              "; e.g. fsdp::init_device_mesh(\"cpu\", {replicas, shards}, "
              "{\"replicate\", \"shard\"}): dim 0 replicates, dim 1 shards");
  return MeshInfo{mesh, 1, 0, {}};
}

}  // namespace detail
}  // namespace fsdp
