// fsdp/tensor_parallel.h — tensor parallelism (Megatron-style) for LibTorch modules: Linear
// layers whose weights are split over the tp dimension of a mesh, with the tp collectives
// explicit in their forward and backward, and `parallelize` for the reference Transformer.
//
//   auto mesh = fsdp::init_device_mesh("cpu", {world / 2, 2}, {"dp", "tp"});
//   torch::manual_seed(0);                              // every rank builds the same full model
//   auto model = fsdp::models::Transformer(args);
//   fsdp::tp::parallelize(model, fsdp::tp::TensorParallelMesh(mesh, "tp"));   // split it over tp
//   auto dp = fsdp::DataParallelMeshDims().shard("dp");
//   for (auto& block : model->blocks()) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(dp));
//   fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(dp));
//
// A column-parallel Linear holds rows [r*out/tp, (r+1)*out/tp) of the weight (and bias) on tp
// rank r: its input must be the same on every tp rank, its output is this rank's slice of the
// output features; backward all-reduces the input's gradient over tp (each rank only has its
// slice's contribution). A row-parallel Linear holds columns [r*in/tp, (r+1)*in/tp) of the
// weight and the whole bias: its input is this rank's slice of the input features (what a
// column-parallel layer produced), its forward all-reduces the partial products over tp, then
// adds the bias once; backward needs no communication. Their parameters keep LibTorch's names
// (weight, bias) and are registered as DTensors on the mesh (fsdp/dtensor_parameter.h):
// Shard(0) (column) / Shard(1) (row) on tp, Replicate() on every other mesh dim.
//
// Every collective here is on the tp dim's process group, issued in forward or backward in the
// same order on every tp rank; nothing communicates at construction.
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>

namespace fsdp {

namespace models {
struct ModelArgs;
class TransformerImpl;
class TransformerBlockImpl;
}  // namespace models

namespace tp {

// Identity in forward; all-reduces (sums) the gradient over `group` in backward. Put before a
// column-parallel computation whose input is replicated over tp.
at::Tensor copy_to_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);
// All-reduces (sums) over `group` in forward; identity in backward. Put after a row-parallel
// computation whose output is a partial sum on each tp rank.
at::Tensor reduce_from_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);

// Where a tensor-parallel layer lives: a mesh and the name of its tp dim ("" for a 1-D mesh:
// its one dim). Every other mesh dim holds copies (Replicate()).
struct TensorParallelMesh {
  TensorParallelMesh(DeviceMesh mesh, std::string tp_dim = "");
  const DeviceMesh& mesh() const { return mesh_; }
  int64_t tp_dim() const { return tp_dim_; }
  int64_t size() const { return mesh_.size(tp_dim_); }
  int64_t rank() const { return mesh_.get_local_rank(tp_dim_); }
  std::shared_ptr<ProcessGroup> group() const { return mesh_.get_group(tp_dim_); }

 private:
  DeviceMesh mesh_;
  int64_t tp_dim_;
};

// A Linear with its output features split over tp. It is a LinearImpl (same options, same
// parameter names) holding this rank's rows; forward(x) = linear(copy_to_tp_region(x), w, b).
// Built from the full layer (equal on every tp rank), whose weights it copies its rows from (like
// LinearImpl, its constructor draws initial values from the global generator first).
// out_features must be divisible by the tp size (throws c10::Error naming both otherwise).
class ColumnParallelLinearImpl : public torch::nn::LinearImpl {
 public:
  ColumnParallelLinearImpl(const torch::nn::LinearImpl& full, const TensorParallelMesh& tp);
  at::Tensor forward(const at::Tensor& x);

 private:
  std::shared_ptr<ProcessGroup> group_;
};
TORCH_MODULE(ColumnParallelLinear);

// A Linear with its input features split over tp: this rank's columns of the weight, the whole
// bias; forward(x_local) = reduce_from_tp_region(x_local w_local^T) + b. in_features must be
// divisible by the tp size.
class RowParallelLinearImpl : public torch::nn::LinearImpl {
 public:
  RowParallelLinearImpl(const torch::nn::LinearImpl& full, const TensorParallelMesh& tp);
  at::Tensor forward(const at::Tensor& x);

 private:
  std::shared_ptr<ProcessGroup> group_;
};
TORCH_MODULE(RowParallelLinear);

// Calls `linear` through fsdp::call with the forward of its actual class: a ColumnParallelLinear
// or RowParallelLinear put in place of a torch::nn::Linear member runs its own forward (LinearImpl's
// forward is not virtual). Model code calls its Linear members through this.
at::Tensor call_linear(const torch::nn::Linear& linear, const at::Tensor& x);

// The Megatron plan for the reference Transformer (fsdp/models/transformer.h), in place, on
// every rank of `tp.mesh()`:
//  - attention: wq, wk, wv column-parallel, wo row-parallel, so each tp rank computes
//    n_heads / tp whole heads (heads h*tp_rank.. of the full model, in order);
//  - feed-forward: w1 column-parallel, w2 row-parallel (the GELU between them is elementwise);
//  - tok_embeddings, pos_embeddings, the norms and the output head stay whole on every tp rank
//    (Replicate()): the vocabularies of the presets are small next to the blocks, and a whole
//    head keeps the loss and the logits unchanged (no parallel cross-entropy). Their gradients
//    are the same on every tp rank, since every tp rank sees the same activations outside the
//    split layers.
// Every parameter is then registered as a DTensor on tp.mesh() (fsdp/dtensor_parameter.h).
// The model must be whole and equal on every tp rank (the same seed), before fully_shard.
// Throws c10::Error when n_heads or dim is not divisible by the tp size, naming them. The tp
// rank's forward then needs the whole batch of its tp group (the same input on every tp rank).
void parallelize(models::TransformerImpl& model, const TensorParallelMesh& tp);
// The same, a piece at a time, for a model built block by block (so that the whole model never
// exists on one rank: sharded_transformer's way): parallelize_block on each block as it is built
// (the hook of TransformerImpl's constructor, before fully_shard of the block), then
// register_replicated on the finished model for the parameters outside the blocks. Together they
// do exactly what parallelize does.
void parallelize_block(models::TransformerBlockImpl& block, const models::ModelArgs& args, const TensorParallelMesh& tp);
void register_replicated(torch::nn::Module& model, const TensorParallelMesh& tp);
template <typename Holder>
void parallelize(Holder& model, const TensorParallelMesh& tp) {
  parallelize(*model, tp);
}

// The checks parallelize makes, for callers that want them before building anything (e.g. a
// trainer reading its configuration): throws c10::Error naming the model field and the tp size.
void check_parallelizable(int64_t n_heads, int64_t dim, int64_t tp_size);

}  // namespace tp
}  // namespace fsdp
