// layer: tensor (what may include what: docs/architecture.md)
/// \file
/// fsdp/device_mesh.h — a logical n-D arrangement of the world's ranks, with one process group
/// per mesh dimension.
///
/// \code{.cpp}
///   fsdp::init_process_group();
///   auto mesh = fsdp::init_device_mesh("cpu", {world_size}, {"dp"});          // FSDP
///   auto hsdp = fsdp::init_device_mesh("cpu", {2, world_size / 2},
///                                      {"replicate", "shard"});               // HSDP
///   auto shard_group = hsdp.get_group("shard");   // my row: ranks that differ only in "shard"
///   auto sub = hsdp["shard"];                      // the 1-D mesh of that row
/// \endcode
///
/// Rank layout is row-major, as in PyTorch: mesh = arange(world).view(shape).
#pragma once

#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// A handle: copies share the same mesh and groups. Cheap to copy; safe to read from any thread.
/// Nothing here communicates. Every accessor throws c10::Error on an empty handle, and on a dim
/// index or name the mesh does not have.
class DeviceMesh {
 public:
  DeviceMesh() = default;  ///< an empty handle; valid() is false

  /// Whether this handle refers to a mesh.
  bool valid() const { return impl_ != nullptr; }
  /// The device type the mesh was made for: "cpu" or "cuda".
  const std::string& device_type() const;
  /// This rank's device: the CPU, or for a "cuda" mesh the GPU init_device_mesh chose.
  c10::Device device() const;
  /** @{ */
  /// The number of mesh dims, the ranks along each, and their names (empty when unnamed).
  int64_t ndim() const;
  std::vector<int64_t> shape() const;
  const std::vector<std::string>& dim_names() const;
  /** @} */
  /// Ranks along mesh dim `dim` (the whole mesh's size when dim is -1).
  int64_t size(int64_t dim = -1) const;
  /// The world ranks of this mesh as an int64 tensor of the mesh's shape.
  at::Tensor mesh() const;
  /// This rank's coordinate in the mesh.
  std::vector<int64_t> coordinate() const;
  /** @{ */
  /// This rank's index along mesh dim `dim` (= its rank in get_group(dim)).
  int64_t get_local_rank(int64_t dim = 0) const;
  int64_t get_local_rank(const std::string& dim_name) const;
  /** @} */
  /** @{ */
  /// The process group of the ranks that share this rank's coordinate on every other dim.
  std::shared_ptr<ProcessGroup> get_group(int64_t dim = 0) const;
  std::shared_ptr<ProcessGroup> get_group(const std::string& dim_name) const;
  /** @} */
  /// The 1-D mesh along `dim_name` that contains this rank. Shares the group with this mesh.
  DeviceMesh operator[](const std::string& dim_name) const;
  /// Index of the named dim; throws naming the known dims when absent.
  int64_t dim_index(const std::string& dim_name) const;

  /** @{ */
  /// Two handles are equal when they share one mesh.
  bool operator==(const DeviceMesh& o) const { return impl_ == o.impl_; }
  bool operator!=(const DeviceMesh& o) const { return impl_ != o.impl_; }
  /** @} */
  /// The mesh for messages: its device type, shape, dim names and ranks.
  std::string str() const;

 private:
  struct Impl;  ///< device_mesh.cpp

  explicit DeviceMesh(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  friend DeviceMesh init_device_mesh(const std::string&, const std::vector<int64_t>&, const std::vector<std::string>&);
  /// The mesh; throws c10::Error naming init_device_mesh() when this handle is empty.
  const Impl& checked_impl() const;

  std::shared_ptr<const Impl> impl_;
};

/// Builds a mesh over all ranks of the world. Collective: every rank calls it with the same
/// arguments, in the same order as its other mesh and group creations. Creates one process group
/// per mesh dim that contains this rank (blocks until their members have connected).
/// `device_type` is "cpu" or "cuda". A "cuda" mesh puts each rank on GPU local_rank % (GPUs
/// seen), makes it the current device, and runs its groups on NCCL, each bound to that GPU with
/// its communicator made here (NCCL's refusal of two ranks on one GPU throws CollectiveError);
/// FSDP_CUDA_BACKEND=gloo runs them on Gloo instead, with the tensors staged through pinned host
/// memory (several ranks on one GPU). "cuda" throws, saying why, in a build without the CUDA path or on a
/// machine without a GPU. The product of `shape` must equal the world size. `dim_names` is empty
/// or one distinct name per dim.
/// Throws c10::Error on arguments that break these rules, before any communication, and
/// CollectiveError when the members of a group do not all connect within the timeout.
DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names = {});

}  // namespace fsdp
