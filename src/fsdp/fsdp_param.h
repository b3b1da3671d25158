// fsdp_param.h — one parameter under FSDP: how it is chunked, and its two faces.
//
// The sharded face is a new leaf tensor (this rank's torch.chunk piece along the shard dim, 0
// unless shard_on() chose another, a view into the group's flat shard buffer) that replaces the parameter in its module's parameter registry, so that
// parameters(), named_parameters() and every optimizer see only it. The unsharded face is the
// original tensor, which the module's member (e.g. LinearImpl::weight) keeps pointing to and
// autograd computes with; its storage is resized to zero bytes while sharded and refilled in
// place when gathered, so views that autograd saved stay valid. It never moves. Under a
// mixed-precision policy the unsharded face takes the compute dtype (e.g. bf16) while the
// sharded leaf keeps the original one (e.g. fp32), so the optimizer sees only the latter.
//
// This file owns no communication and no buffer layout: the group (param_group.h) decides when
// bytes move, collectives.h where they go, and this record what each parameter is.
#pragma once

#include <fsdp/placement.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {
namespace detail {

class FSDPParam {
 public:
  // `unsharded` is the parameter as registered before sharding (contiguous, owning its storage).
  // The data is not moved here: the group copies it into its flat shard buffer (copy_shard_to).
  FSDPParam(std::string fqn, at::Tensor unsharded, int64_t world, int64_t rank);

  const std::string& fqn() const { return fqn_; }
  // The original (global) shape, and the dtype of the sharded leaf (the original dtype).
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  at::ScalarType orig_dtype() const { return orig_dtype_; }
  // The dtype of the unsharded face: the compute dtype (orig_dtype() without a policy).
  at::ScalarType unsharded_dtype() const { return unsharded_.scalar_type(); }
  // Whether the unsharded face takes a gradient: the sharded leaf's requires_grad as of the
  // latest copy_requires_grad_from_shard (the forward that produced this backward's graph).
  bool requires_grad() const { return unsharded_.requires_grad(); }
  // The user freezes and unfreezes the registered shard (module->parameters()); the unsharded
  // face autograd computes with follows it at each forward.
  void copy_requires_grad_from_shard();

  // Shards along tensor dim `dim` instead of dim 0 (negative: counted from the end), as chosen
  // by FullyShardOptions::shard_placement_fn. Called before the group lays out the shard. A dim
  // other than 0 must split evenly over the ranks (FSDP pads only along dim 0); throws
  // c10::Error naming the parameter otherwise, or when the dim is out of range.
  void shard_on(int64_t dim);
  int64_t shard_dim() const { return shard_dim_; }
  int64_t shard_rank() const { return rank_; }  // this rank's index in the shard group

  // Chunking over `world` ranks along shard_dim() (torch.chunk), each chunk padded to the same
  // size (only along dim 0: any other dim splits evenly, without padding).
  int64_t padded_shard_numel() const { return padded_shard_numel_; }  // identical on every rank
  int64_t shard_length() const { return shard_length_; }  // this rank's indices along shard_dim() (may be 0)
  int64_t shard_offset() const { return shard_offset_; }  // where they start
  int64_t unsharded_numel() const { return unsharded_numel_; }
  // Elements per index of shard_dim() within one block of the dims before it: the product of
  // the later dims (for dim 0, the elements of one row).
  int64_t inner_numel() const;
  // The product of the dims before shard_dim() (1 for dim 0): how many separate runs of
  // elements one rank's piece is made of in the unsharded tensor's row-major layout.
  int64_t outer_numel() const;

  // This rank's shape of the parameter: the global shape with shard_length() along shard_dim().
  std::vector<int64_t> sharded_shape() const;
  // Makes the sharded leaf a view of `flat_shard` at element `offset`, with the sharded shape.
  void init_sharded(const at::Tensor& flat_shard, int64_t offset);

  const at::Tensor& sharded() const { return sharded_; }
  const at::Tensor& unsharded() const { return unsharded_; }

  // Whether the sharded leaf is still the view of `flat_shard` that init_sharded (or
  // reset_sharded) made: LibTorch's Module::to(dtype or device) and set_data() give it storage
  // of its own, in place (the same TensorImpl).
  bool shard_views(const at::Tensor& flat_shard) const;
  // FSDP2's reset_sharded_param: copies the leaf's values (whatever dtype and storage it has now)
  // into its piece of `flat_shard` (a new flat shard in the leaf's dtype, on its device) at
  // `offset`, and makes the leaf a view of that piece again. The TensorImpl stays the same one,
  // so the module and the optimizer keep it. Its gradient is converted alike (PyTorch's
  // Module._apply converts it with the parameter; LibTorch's Module::to does not), and the leaf's
  // dtype becomes orig_dtype().
  void reset_sharded(const at::Tensor& flat_shard, int64_t offset);
  // After reset_sharded: the unsharded face takes `dtype` (the compute dtype resolved for the new
  // one) with empty storage of its own (it stops aliasing the old shard), and its gradients are
  // converted: autograd's to `dtype`, the no-sync accumulator to `reduce_dtype`.
  void reset_unsharded(at::ScalarType dtype, at::ScalarType reduce_dtype);

  // The unsharded storage: allocated for `padded_full_numel()` elements (all ranks' padded
  // chunks, rank-major, so the real data is the prefix), or zero bytes.
  int64_t padded_full_numel() const { return padded_shard_numel_ * world_; }
  bool is_unsharded_allocated() const;
  void alloc_unsharded();
  void free_unsharded();
  // The allocated unsharded storage, every padded piece, as a flat tensor of its own, for the
  // copies into and out of it: not an autograd view of the parameter, so writing through it
  // leaves the version counter of autograd's saved views alone. Made at the first call and kept,
  // as it follows the storage through every free and allocation.
  const at::Tensor& unsharded_storage() const;
  // World size 1 without a cast: the unsharded tensor aliases the shard (no copies, never freed).
  bool aliases_shard() const { return aliases_shard_; }
  void alias_shard(const at::Tensor& flat_shard, int64_t offset);
  // Frees the unsharded storage and gives the unsharded face `dtype` (the policy's param dtype).
  // The TensorImpl stays the same one, so the module's member keeps working.
  void set_unsharded_dtype(at::ScalarType dtype);

  // With dp_mesh_dims: the layout of the unsharded tensor on the whole mesh before FSDP (its
  // DTensor parameter record: Replicate() on the dp dim, e.g. Shard(0) on tp) and the shape
  // of the whole tensor it is a piece of. FSDP itself only sees the unsharded (local) tensor;
  // as_dtensor composes the two layouts.
  void set_model_layout(std::vector<Placement> placements, std::vector<int64_t> global_shape) {
    model_placements_ = std::move(placements);
    model_global_shape_ = std::move(global_shape);
  }
  bool has_model_layout() const { return !model_placements_.empty(); }
  const std::vector<Placement>& model_placements() const { return model_placements_; }
  const std::vector<int64_t>& model_global_shape() const { return model_global_shape_; }

  // Gradient of the unsharded tensor (full shape) from autograd.
  at::Tensor unsharded_grad() const { return unsharded_.grad(); }
  // Without gradient sync: moves autograd's gradient into an accumulator of `dtype` (the reduce
  // dtype, wider than the compute dtype), adding it to what earlier micro-batches left there.
  void accumulate_unsharded_grad(at::ScalarType dtype);
  // The gradient to reduce: the accumulator with autograd's gradient added, if there is an
  // accumulator; autograd's gradient otherwise; undefined when there is neither.
  at::Tensor unsharded_grad_to_reduce();
  bool has_unsharded_grad() const { return unsharded_.grad().defined() || accumulated_grad_.defined(); }
  // Drops autograd's gradient and the accumulator.
  void clear_unsharded_grad();
  // Adds (or sets) `shard_grad` (shard shape; may alias a reduce-scatter output) as the grad of
  // the sharded leaf.
  void accumulate_sharded_grad(const at::Tensor& shard_grad);

 private:
  std::string fqn_;
  at::Tensor unsharded_;
  at::Tensor sharded_;
  at::Tensor accumulated_grad_;           // see accumulate_unsharded_grad
  mutable at::Tensor unsharded_storage_;  // see unsharded_storage()
  at::ScalarType orig_dtype_;
  std::vector<int64_t> global_shape_;
  int64_t world_;
  int64_t rank_;
  int64_t unsharded_numel_;
  int64_t shard_dim_ = 0;
  int64_t padded_shard_numel_;
  int64_t shard_length_;
  int64_t shard_offset_;
  bool aliases_shard_ = false;
  std::vector<Placement> model_placements_;  // empty without dp_mesh_dims
  std::vector<int64_t> model_global_shape_;
};

// A group's parameters, in group order (the order of every layout in collectives.h).
using FSDPParams = std::vector<std::unique_ptr<FSDPParam>>;

}  // namespace detail
}  // namespace fsdp
