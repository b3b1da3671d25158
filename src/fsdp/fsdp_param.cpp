#include "src/fsdp/fsdp_param.h"

#include "src/device/device_ops.h"
#include "src/device/stream_check.h"

#include <fsdp/device.h>
#include <fsdp/placement.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace fsdp {
namespace detail {

FSDPParam::FSDPParam(std::string fqn, at::Tensor unsharded, int64_t world, int64_t rank)
    : fqn_(std::move(fqn)), unsharded_(std::move(unsharded)), world_(world), rank_(rank) {
  const at::Tensor& u = unsharded_;
  TORCH_CHECK(u.dim() >= 1, "fully_shard: parameter '", fqn_,
              "' is a scalar (0-dim); FSDP shards along dim 0 "
              "and needs at least one dim. Make it shape [1], or keep it out of the FSDP module.");
  // PyTorch's meta-device initialisation (fully_shard on meta, then to_empty() and
  // reset_parameters()) needs modules that can re-create their parameters on another device; C++
  // modules allocate and initialise theirs in their constructors only.
  TORCH_CHECK(!u.is_meta(), "fully_shard: parameter '", fqn_,
              "' is on the meta device; meta-device "
              "initialisation is not supported yet (LibTorch's C++ modules have no to_empty(), and allocate and "
              "initialise their parameters in their constructors). Build the model on the CPU, sharding each "
              "block as soon as it is built (models::sharded_transformer shows how).");
  TORCH_CHECK(device::has_ops_for(u.device().type()), "fully_shard: parameter '", fqn_, "' is on ", u.device(),
              "; this build of fsdp-cpp shards parameters on the CPU", built_with_cuda() ? " and CUDA" : "", " only");
  TORCH_CHECK(u.is_contiguous() && u.storage_offset() == 0 &&
                  u.storage().nbytes() == static_cast<size_t>(u.numel()) * u.element_size(),
              "fully_shard: parameter '", fqn_,
              "' does not own a contiguous storage of its own (it is a view or "
              "non-contiguous); FSDP frees and refills each parameter's storage, so give it its own (e.g. clone())");
  global_shape_ = u.sizes().vec();
  orig_dtype_ = u.scalar_type();
  unsharded_numel_ = u.numel();
  shard_on(0);
}

void FSDPParam::shard_on(int64_t dim) {
  const int64_t ndim = static_cast<int64_t>(global_shape_.size());
  TORCH_CHECK(dim >= -ndim && dim < ndim, "fully_shard: Shard(", dim, ") for parameter '", fqn_, "' of shape ",
              c10::IntArrayRef(global_shape_), " is invalid for a ", ndim, "-D tensor; choose a dim in [", -ndim, ", ",
              ndim, ")");
  const int64_t d = dim < 0 ? dim + ndim : dim;
  const int64_t size = global_shape_[d];
  // Padding exists only along dim 0, where it is the suffix of the gathered buffer; a padded
  // inner dim would interleave padding with data in every block.
  TORCH_CHECK(d == 0 || size % world_ == 0, "fully_shard: FSDP does not support uneven sharding on dim ", d,
              ": parameter '", fqn_, "' of shape ", c10::IntArrayRef(global_shape_), " has size ", size, " on dim ", d,
              ", which ", world_,
              " ranks do not divide; return Shard(0) (or nothing) from "
              "shard_placement_fn for it, or a dim whose size the shard group size divides");
  shard_dim_ = d;
  const int64_t chunk = (size + world_ - 1) / world_;
  padded_shard_numel_ = chunk * inner_numel() * outer_numel();
  const ChunkBounds b = chunk_bounds(size, world_, rank_);
  shard_length_ = b.length;
  shard_offset_ = b.offset;
}

int64_t FSDPParam::inner_numel() const {
  int64_t n = 1;
  for (size_t d = static_cast<size_t>(shard_dim_) + 1; d < global_shape_.size(); ++d) n *= global_shape_[d];
  return n;
}

int64_t FSDPParam::outer_numel() const {
  int64_t n = 1;
  for (int64_t d = 0; d < shard_dim_; ++d) n *= global_shape_[d];
  return n;
}

std::vector<int64_t> FSDPParam::sharded_shape() const {
  std::vector<int64_t> shape = global_shape_;
  shape[shard_dim_] = shard_length_;
  return shape;
}

void FSDPParam::init_sharded(const at::Tensor& flat_shard, int64_t offset) {
  const std::vector<int64_t> shape = sharded_shape();
  at::Tensor s = at::empty({0}, flat_shard.options());
  s.set_(flat_shard.storage(), flat_shard.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  s.set_requires_grad(unsharded_.requires_grad());
  sharded_ = std::move(s);
}

bool FSDPParam::shard_views(const at::Tensor& flat_shard) const {
  return sharded_.scalar_type() == flat_shard.scalar_type() && sharded_.device() == flat_shard.device() &&
         sharded_.storage().is_alias_of(flat_shard.storage());
}

void FSDPParam::reset_sharded(const at::Tensor& flat_shard, int64_t offset) {
  at::NoGradGuard no_grad;
  const std::vector<int64_t> shape = sharded_shape();
  at::Tensor piece = at::empty({0}, flat_shard.options());
  piece.set_(flat_shard.storage(), flat_shard.storage_offset() + offset, shape, c10::contiguous_strides(shape));
  piece.copy_(sharded_);
  at::Tensor grad = sharded_.grad();
  // set_data keeps the TensorImpl, its autograd metadata (requires_grad, the gradient) and its
  // version counter; only the storage, dtype and strides change.
  sharded_.set_data(piece);
  if (grad.defined() && (grad.scalar_type() != piece.scalar_type() || grad.device() != piece.device())) {
    sharded_.mutable_grad() = grad.to(piece.options());
  }
  orig_dtype_ = piece.scalar_type();
}

void FSDPParam::reset_unsharded(at::ScalarType dtype, at::ScalarType reduce_dtype) {
  c10::TensorImpl* impl = unsharded_.unsafeGetTensorImpl();
  if (aliases_shard_) {
    // Its storage is the old flat shard's: it takes an empty one of its own (resharded).
    impl->set_storage_and_dtype(at::empty({0}, unsharded_.options().dtype(dtype)).storage(),
                                caffe2::TypeMeta::fromScalarType(dtype));
    impl->set_storage_offset(0);
    aliases_shard_ = false;
  } else {
    set_unsharded_dtype(dtype);
  }
  unsharded_storage_ = at::Tensor();
  at::NoGradGuard no_grad;
  const at::Tensor grad = unsharded_.grad();
  if (grad.defined() && grad.scalar_type() != dtype) unsharded_.mutable_grad() = grad.to(dtype);
  if (accumulated_grad_.defined() && accumulated_grad_.scalar_type() != reduce_dtype) {
    accumulated_grad_ = accumulated_grad_.to(reduce_dtype);
  }
}

void FSDPParam::copy_requires_grad_from_shard() {
  if (unsharded_.requires_grad() != sharded_.requires_grad()) unsharded_.set_requires_grad(sharded_.requires_grad());
}

bool FSDPParam::is_unsharded_allocated() const { return aliases_shard_ || unsharded_.storage().nbytes() > 0; }

void FSDPParam::alloc_unsharded() {
  if (aliases_shard_) return;
  device::ops_for(unsharded_.device())
      .resize_storage(*unsharded_.storage().unsafeGetStorageImpl(),
                      static_cast<size_t>(padded_full_numel()) * unsharded_.element_size());
  if (device::stream_check::enabled())
    device::stream_check::label(unsharded_, "the unsharded parameter '" + fqn_ + "'");
}

void FSDPParam::free_unsharded() {
  if (aliases_shard_) return;
  device::ops_for(unsharded_.device()).resize_storage(*unsharded_.storage().unsafeGetStorageImpl(), 0);
}

// Made while the storage is allocated: set_ would allocate a storage too small for the sizes.
const at::Tensor& FSDPParam::unsharded_storage() const {
  const at::Tensor& u = unsharded_;
  if (!unsharded_storage_.defined() || unsharded_storage_.scalar_type() != u.scalar_type() ||
      !unsharded_storage_.storage().is_alias_of(u.storage())) {
    TORCH_CHECK(is_unsharded_allocated(), "internal: the unsharded storage of '", fqn_, "' is not allocated");
    at::Tensor flat = at::empty({0}, u.options());
    flat.set_(u.storage(), 0, {padded_full_numel()}, {1});
    unsharded_storage_ = std::move(flat);
  }
  return unsharded_storage_;
}

void FSDPParam::alias_shard(const at::Tensor& flat_shard, int64_t offset) {
  // Same TensorImpl (the module member keeps pointing at it), new storage: the shard's.
  c10::TensorImpl* impl = unsharded_.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(flat_shard.storage());
  impl->set_storage_offset(flat_shard.storage_offset() + offset);
  aliases_shard_ = true;
}

void FSDPParam::set_unsharded_dtype(at::ScalarType dtype) {
  TORCH_CHECK(!aliases_shard_, "internal: '", fqn_, "' aliases its shard; its dtype cannot change");
  free_unsharded();
  c10::TensorImpl* impl = unsharded_.unsafeGetTensorImpl();
  impl->set_storage_and_dtype(unsharded_.storage(), caffe2::TypeMeta::fromScalarType(dtype));
}

void FSDPParam::accumulate_unsharded_grad(at::ScalarType dtype) {
  at::Tensor g = unsharded_.grad();
  if (!g.defined()) return;
  at::NoGradGuard no_grad;
  if (accumulated_grad_.defined()) {
    accumulated_grad_.add_(g);  // add_ widens the bf16 operand itself
  } else {
    accumulated_grad_ = g.to(dtype);
  }
  unsharded_.mutable_grad().reset();
}

at::Tensor FSDPParam::unsharded_grad_to_reduce() {
  if (!accumulated_grad_.defined()) return unsharded_.grad();
  accumulate_unsharded_grad(accumulated_grad_.scalar_type());
  return accumulated_grad_;
}

void FSDPParam::clear_unsharded_grad() {
  if (unsharded_.grad().defined()) unsharded_.mutable_grad().reset();
  accumulated_grad_ = at::Tensor();
}

void FSDPParam::accumulate_sharded_grad(const at::Tensor& shard_grad) {
  if (sharded_.grad().defined()) {
    at::NoGradGuard no_grad;
    sharded_.mutable_grad().add_(shard_grad);
  } else {
    sharded_.mutable_grad() = shard_grad;
  }
}

}  // namespace detail
}  // namespace fsdp
