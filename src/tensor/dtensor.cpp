// DTensor: layout arithmetic (torch.chunk per mesh dim) and the collectives that change it.
#include <fsdp/dtensor.h>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace {

int64_t normalize_dim(int64_t dim, int64_t ndim) {
  const int64_t d = dim < 0 ? dim + ndim : dim;
  TORCH_CHECK(d >= 0 && d < ndim, "fsdp::DTensor: Shard(", dim, ") is out of range for a ", ndim, "-D tensor");
  return d;
}

std::vector<Placement> normalized(std::vector<Placement> placements, const DeviceMesh& mesh, int64_t tensor_dim) {
  TORCH_CHECK(mesh.valid(), "fsdp::DTensor: the device mesh is empty");
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), "fsdp::DTensor: ", placements.size(),
              " placements for a ", mesh.ndim(), "-D mesh; give one per mesh dim");
  for (auto& p : placements) {
    if (p.is_shard()) {
      const int64_t d = normalize_dim(p.dim(), tensor_dim);
      p = p.is_strided_shard() ? StridedShard(d, p.split_factor()) : Shard(d);
    }
  }
  return placements;
}

// The order in which the mesh dims' splits nest: mesh-dim order, except that a StridedShard
// splits only after every later mesh dim sharding the same tensor dim (so it goes last).
std::vector<int64_t> split_order(const std::vector<Placement>& placements) {
  std::vector<int64_t> order;
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!placements[i].is_strided_shard()) order.push_back(static_cast<int64_t>(i));
  }
  for (size_t i = 0; i < placements.size(); ++i) {
    if (placements[i].is_strided_shard()) order.push_back(static_cast<int64_t>(i));
  }
  return order;
}

bool any_strided(const std::vector<Placement>& placements) {
  for (const auto& p : placements) {
    if (p.is_strided_shard()) return true;
  }
  return false;
}

// This rank's piece of `t` along tensor dim `d` when it is split over mesh dim `i`.
at::Tensor local_chunk(const at::Tensor& t, int64_t d, const DeviceMesh& mesh, int64_t i) {
  const ChunkBounds b = chunk_bounds(t.size(d), mesh.size(i), mesh.get_local_rank(i));
  return t.narrow(d, b.offset, b.length);
}

// Reassembles tensor dim `d`, split over mesh dim `i`, whose unsplit size is `unsplit`.
at::Tensor gather_along(const at::Tensor& local, int64_t d, int64_t unsplit, const DeviceMesh& mesh, int64_t i) {
  auto group = mesh.get_group(i);
  at::Tensor moved = local.movedim(d, 0).contiguous();
  const int64_t inner = local.size(d) > 0 ? moved.numel() / local.size(d) : [&] {
    int64_t n = 1;
    for (int64_t k = 1; k < moved.dim(); ++k) n *= moved.size(k);
    return n;
  }();
  std::vector<int64_t> counts;
  for (int64_t k = 0; k < mesh.size(i); ++k) counts.push_back(chunk_bounds(unsplit, mesh.size(i), k).length * inner);
  std::vector<int64_t> out_shape = moved.sizes().vec();
  out_shape[0] = unsplit;
  at::Tensor out = at::empty(out_shape, moved.options());
  group->all_gather_v(out.view(-1), moved.view(-1), counts)->wait();
  return out.movedim(0, d).contiguous();
}

}  // namespace

std::vector<ChunkBounds> shard_bounds(const std::vector<int64_t>& global_shape, const std::vector<int64_t>& mesh_shape,
                                      const std::vector<int64_t>& coordinate,
                                      const std::vector<Placement>& placements) {
  TORCH_CHECK(placements.size() == mesh_shape.size() && coordinate.size() == mesh_shape.size(),
              "fsdp::shard_bounds: ", placements.size(), " placements and a coordinate of ", coordinate.size(),
              " dims for a ", mesh_shape.size(), "-D mesh; give one of each per mesh dim");
  std::vector<ChunkBounds> bounds;
  for (int64_t s : global_shape) bounds.push_back({0, s});
  for (const int64_t i : split_order(placements)) {
    if (!placements[i].is_shard()) continue;
    const int64_t d = placements[i].dim();
    TORCH_CHECK(d >= 0 && d < static_cast<int64_t>(bounds.size()), "fsdp::shard_bounds: ", placements[i].str(),
                " is out of range for a ", bounds.size(), "-D tensor");
    ChunkBounds& b = bounds[d];
    const ChunkBounds piece = chunk_bounds(b.length, mesh_shape[i], coordinate[i]);
    b = {b.offset + piece.offset, piece.length};
  }
  return bounds;
}

DTensor DTensor::from_local(at::Tensor local, DeviceMesh mesh, std::vector<Placement> placements,
                            std::optional<std::vector<int64_t>> global_shape) {
  TORCH_CHECK(local.defined(), "fsdp::DTensor::from_local: the local tensor is undefined");
  placements = normalized(std::move(placements), mesh, local.dim());
  std::vector<int64_t> shape;
  if (global_shape) {
    shape = *global_shape;
    TORCH_CHECK(static_cast<int64_t>(shape.size()) == local.dim(), "fsdp::DTensor::from_local: global shape ",
                c10::IntArrayRef(shape), " has a different rank than the local tensor ", local.sizes());
    const auto bounds = shard_bounds(shape, mesh.shape(), mesh.coordinate(), placements);
    for (int64_t d = 0; d < local.dim(); ++d) {
      TORCH_CHECK(bounds[d].length == local.size(d), "fsdp::DTensor::from_local: this rank's piece of a ",
                  c10::IntArrayRef(shape), " tensor under these placements has size ", bounds[d].length, " along dim ",
                  d, " but the local tensor has ", local.size(d));
    }
  } else {
    shape = local.sizes().vec();
    for (size_t i = 0; i < placements.size(); ++i) {
      if (placements[i].is_shard()) shape[placements[i].dim()] *= mesh.size(static_cast<int64_t>(i));
    }
  }
  return DTensor(std::move(local), std::move(mesh), std::move(placements), std::move(shape));
}

int64_t DTensor::size(int64_t d) const {
  TORCH_CHECK(d >= 0 && d < dim(), "fsdp::DTensor::size: dim ", d, " is out of range for a ", dim(), "-D tensor");
  return global_shape_[d];
}

int64_t DTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : global_shape_) n *= s;
  return n;
}

std::vector<ChunkBounds> DTensor::local_bounds() const {
  return shard_bounds(global_shape_, mesh_.shape(), mesh_.coordinate(), placements_);
}

at::Tensor DTensor::full_tensor() const {
  return redistribute(std::vector<Placement>(placements_.size(), Replicate())).to_local();
}

DTensor DTensor::redistribute(const std::vector<Placement>& target_in) const {
  TORCH_CHECK(defined(), "fsdp::DTensor::redistribute: the DTensor is undefined");
  const std::vector<Placement> target = normalized(target_in, mesh_, dim());
  const int64_t n = mesh_.ndim();
  int64_t first_change = 0;
  while (first_change < n && placements_[first_change] == target[first_change]) ++first_change;
  if (first_change == n) return *this;
  // A StridedShard reorders the nesting: undo every split then (simple, and rare: checkpoints
  // and full_tensor go to Replicate everywhere anyway).
  if (any_strided(placements_) || any_strided(target)) first_change = 0;

  // Pieces are nested in split order, so undo the splits from the last one back to the first
  // mesh dim that changes, then split again in order.
  const std::vector<int64_t> order = split_order(placements_);
  std::vector<Placement> current = placements_;
  at::Tensor local = local_;
  const std::vector<int64_t> coord = mesh_.coordinate();
  for (int64_t pos = n - 1; pos >= 0; --pos) {
    const int64_t i = order[pos];
    if (i < first_change || !current[i].is_shard()) continue;
    const int64_t d = current[i].dim();
    int64_t unsplit = global_shape_[d];  // size along d before mesh dim i split it
    for (int64_t k = 0; k < pos; ++k) {
      const int64_t j = order[k];
      if (current[j].is_shard() && current[j].dim() == d)
        unsplit = chunk_bounds(unsplit, mesh_.size(j), coord[j]).length;
    }
    local = gather_along(local, d, unsplit, mesh_, i);
    current[i] = Replicate();
  }
  bool sliced = false;
  for (const int64_t i : split_order(target)) {
    if (i < first_change || !target[i].is_shard()) continue;
    local = local_chunk(local, target[i].dim(), mesh_, i);
    sliced = true;
  }
  // A slice of a gathered or shared tensor would pin all of it; keep only this rank's piece.
  if (sliced) local = local.contiguous().clone();
  return DTensor(std::move(local), mesh_, target, global_shape_);
}

DTensor distribute_tensor(const at::Tensor& full, const DeviceMesh& mesh, std::vector<Placement> placements,
                          std::optional<int64_t> src_data_rank) {
  TORCH_CHECK(full.defined(), "fsdp::distribute_tensor: the tensor is undefined");
  placements = normalized(std::move(placements), mesh, full.dim());
  at::Tensor data = full.contiguous();
  if (src_data_rank) {
    TORCH_CHECK(*src_data_rank >= 0 && *src_data_rank < mesh.size(), "fsdp::distribute_tensor: src_data_rank ",
                *src_data_rank, " is not a rank of a mesh of ", mesh.size());
    // Coordinates of the source; broadcast along the last dim within its row, then along
    // each earlier dim, so that every rank ends up with the source's data.
    const std::vector<int64_t> shape = mesh.shape();
    std::vector<int64_t> src(shape.size());
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1, rest = *src_data_rank; d >= 0; --d) {
      src[d] = rest % shape[d];
      rest /= shape[d];
    }
    const std::vector<int64_t> me = mesh.coordinate();
    if (me != src) data = data.clone();  // we will receive into it; leave the caller's tensor alone
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      bool in_row = true;
      for (int64_t k = 0; k < d; ++k) in_row = in_row && me[k] == src[k];
      if (in_row) mesh.get_group(d)->broadcast(data, static_cast<int>(src[d]))->wait();
    }
  }
  const auto bounds = shard_bounds(full.sizes().vec(), mesh.shape(), mesh.coordinate(), placements);
  at::Tensor local = data;
  for (int64_t d = 0; d < full.dim(); ++d) local = local.narrow(d, bounds[d].offset, bounds[d].length);
  local = local.contiguous().clone();
  return DTensor(std::move(local), mesh, std::move(placements), full.sizes().vec());
}

}  // namespace fsdp
