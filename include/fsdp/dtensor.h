// layer: tensor (what may include what: docs/architecture.md)
/// \file
/// fsdp/dtensor.h — a tensor distributed over a DeviceMesh: this rank's local piece, the mesh,
/// one Placement per mesh dim, and the global shape.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {world});
///   at::Tensor full = at::randn({10, 4});                       // same on every rank
///   fsdp::DTensor d = fsdp::distribute_tensor(full, mesh, {fsdp::Shard(0)});
///   d.to_local();      // rows [3r, 3r+3) with torch.chunk rules (rank 3 of 4 gets 1 row)
///   d.full_tensor();   // all-gathers: equals `full` on every rank
/// \endcode
///
/// Sharding follows torch.chunk along the sharded dim, applied mesh dim by mesh dim in order;
/// the last ranks may hold shorter or empty pieces. Methods that communicate are marked
/// "collective": every rank of the mesh must call them, in the same order.
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/placement.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace fsdp {

/// A distributed tensor: this rank's piece (a plain at::Tensor), the mesh it is spread over, one
/// Placement per mesh dim, and the global shape. Values are shared with the local tensor; only
/// full_tensor() and the other methods that say so communicate.
class DTensor {
 public:
  DTensor() = default;  ///< undefined; defined() is false

  /// Wraps this rank's piece. No communication. Without `global_shape`, the pieces are assumed
  /// to be even (global size = local size x mesh dim size along each sharded dim), as PyTorch's
  /// from_local does; pass the shape for uneven (torch.chunk) layouts. The local tensor is
  /// shared, not copied.
  static DTensor from_local(at::Tensor local, DeviceMesh mesh, std::vector<Placement> placements,
                            std::optional<std::vector<int64_t>> global_shape = std::nullopt);

  /// Whether this DTensor holds a tensor.
  bool defined() const { return local_.defined(); }
  /// This rank's piece (shares storage with the DTensor).
  const at::Tensor& to_local() const { return local_; }
  /// Returned by value: a DTensor is often a temporary (fsdp::as_dtensor(p).placements()).
  DeviceMesh device_mesh() const { return mesh_; }
  /// How the tensor is spread over each mesh dim: one Placement per dim.
  std::vector<Placement> placements() const { return placements_; }
  /** @{ */
  /// The global (logical) shape, and its size along `dim` (0 <= dim < dim(); throws c10::Error
  /// otherwise).
  std::vector<int64_t> sizes() const { return global_shape_; }
  int64_t size(int64_t dim) const;
  /** @} */
  /** @{ */
  /// The number of dims, elements and the dtype of the global tensor.
  int64_t dim() const { return static_cast<int64_t>(global_shape_.size()); }
  int64_t numel() const;
  at::ScalarType scalar_type() const { return local_.scalar_type(); }
  /** @} */

  /// The whole tensor on every rank. Collective; allocates a new tensor of the global shape.
  at::Tensor full_tensor() const;
  /// The same data with other placements (Shard `<->` Replicate, per mesh dim). Collective when
  /// any dim goes from Shard to something else; going to Shard is a local slice (copied, so the
  /// result does not keep the source's storage alive).
  DTensor redistribute(const std::vector<Placement>& placements) const;

  /// Where this rank's piece sits in the global tensor: offset and length per tensor dim.
  std::vector<ChunkBounds> local_bounds() const;

 private:
  DTensor(at::Tensor local, DeviceMesh mesh, std::vector<Placement> placements, std::vector<int64_t> shape)
      : local_(std::move(local)),
        mesh_(std::move(mesh)),
        placements_(std::move(placements)),
        global_shape_(std::move(shape)) {}
  friend DTensor distribute_tensor(const at::Tensor&, const DeviceMesh&, std::vector<Placement>,
                                   std::optional<int64_t>);

  at::Tensor local_;
  DeviceMesh mesh_;
  std::vector<Placement> placements_;
  std::vector<int64_t> global_shape_;
};

/// Where the piece at `coordinate` of `mesh_shape` sits in a tensor of `global_shape` under
/// `placements` (torch.chunk rules, mesh dims applied in order). No communication. Throws
/// c10::Error unless there is one placement and one coordinate per mesh dim and every Shard
/// dim is a dim of `global_shape`.
std::vector<ChunkBounds> shard_bounds(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& mesh_shape,
                                      const std::vector<int64_t>& coordinate, const std::vector<Placement>& placements);

/// Splits `full` over `mesh` with `placements` and returns this rank's DTensor.
/// With src_data_rank = r (default 0) the data of the mesh's r-th rank is used: it is broadcast
/// first, so `full` on the other ranks only needs the right shape and dtype (collective).
/// With std::nullopt every rank is trusted to hold the same `full` and nothing is sent.
DTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, std::vector<Placement> placements,
                          std::optional<int64_t> src_data_rank = 0);

}  // namespace fsdp
