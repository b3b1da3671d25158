// default_mesh.h — the mesh fully_shard and replicate use when their options name none.
#pragma once

#include <fsdp/device_mesh.h>

namespace fsdp {
namespace detail {

// A 1-D "cpu" mesh over every rank of the world, made on first use (collective) and made again
// after the process group was destroyed and initialised anew (the old mesh's groups are dead
// then). Thread-safe.
DeviceMesh default_world_mesh();

}  // namespace detail
}  // namespace fsdp
