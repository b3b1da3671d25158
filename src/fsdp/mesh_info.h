// mesh_info.h — which dims of a fully_shard mesh shard and which replicate: a 1-D mesh shards
// over its one dim (FSDP); a 2-D mesh (HSDP) replicates over dim 0 and shards over dim 1. The one
// place that reads a mesh's shape for FSDP; everything else asks this record.
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/placement.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fsdp {
namespace detail {

struct MeshInfo {
  DeviceMesh mesh;
  int64_t shard_dim = 0;       // the mesh dim parameters are split over (the last)
  int64_t replicate_dim = -1;  // HSDP: 0; -1 without a replicate dim

  bool is_hsdp() const { return replicate_dim >= 0; }
  int64_t shard_size() const { return mesh.size(shard_dim); }
  int64_t shard_rank() const { return mesh.get_local_rank(shard_dim); }
  // 1 without HSDP.
  int64_t replicate_size() const { return is_hsdp() ? mesh.size(replicate_dim) : 1; }
  std::shared_ptr<ProcessGroup> shard_group() const { return mesh.get_group(shard_dim); }
  // Null without HSDP.
  std::shared_ptr<ProcessGroup> replicate_group() const { return is_hsdp() ? mesh.get_group(replicate_dim) : nullptr; }
  // The DTensor placements of a parameter sharded along tensor dim `tensor_dim`: (Shard(d)), or
  // under HSDP (Replicate(), Shard(d)).
  std::vector<Placement> placements(int64_t tensor_dim = 0) const;
};

// The record of a mesh fully_shard accepts: 1-D, or 2-D with dim names (HSDP). Throws c10::Error
// saying what to pass for any other mesh.
MeshInfo mesh_info_of(const DeviceMesh& mesh);

}  // namespace detail
}  // namespace fsdp
