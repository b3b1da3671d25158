// mesh_info.cpp — the meshes fully_shard accepts and what each of their dims does.
#include "src/fsdp/mesh_info.h"

#include <c10/util/Exception.h>

namespace fsdp {
namespace detail {

std::vector<Placement> MeshInfo::placements(int64_t tensor_dim) const {
  if (is_hsdp()) return {Replicate(), Shard(tensor_dim)};
  return {Shard(tensor_dim)};
}

MeshInfo mesh_info_of(const DeviceMesh& mesh) {
  TORCH_CHECK(mesh.valid(), "fully_shard: the mesh handle is empty; build one with fsdp::init_device_mesh()");
  const int64_t ndim = mesh.ndim();
  TORCH_CHECK(ndim == 1 || ndim == 2, "fully_shard expects a 1-D or 2-D DeviceMesh but got ", mesh.str(),
              "; pass a 1-D mesh (FSDP) or a 2-D mesh with dim names (replicate, shard) for HSDP");
  if (ndim == 1) return MeshInfo{mesh, 0, -1};
  TORCH_CHECK(!mesh.dim_names().empty(), "fully_shard: please init the 2-D mesh for HSDP with mesh_dim_names "
              "specified, got ", mesh.str(), "; e.g. fsdp::init_device_mesh(\"cpu\", {replicas, shards}, "
              "{\"replicate\", \"shard\"}): dim 0 replicates, dim 1 shards");
  return MeshInfo{mesh, 1, 0};
}

}  // namespace detail
}  // namespace fsdp
