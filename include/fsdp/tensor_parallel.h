// layer: tp (what may include what: docs/architecture.md)
/// \file
/// fsdp/tensor_parallel.h — tensor parallelism (Megatron-style) for LibTorch modules: Linear
/// and Embedding layers whose weights are split over the tp dimension of a mesh, with the tp
/// collectives explicit in their forward and backward, and a cross-entropy over logits split by
/// vocabulary. The plan that applies them to the reference Transformer lives beside the model
/// (fsdp/models/parallelize.h); this layer knows no model.
///
/// \code{.cpp}
///   auto mesh = fsdp::init_device_mesh("cpu", {world / 2, 2}, {"dp", "tp"});
///   torch::manual_seed(0);                              // every rank builds the same full model
///   auto model = fsdp::models::Transformer(args);
///   fsdp::models::parallelize(model, fsdp::tp::TensorParallelMesh(mesh, "tp"),
///                             fsdp::models::ParallelizeOptions().vocab_parallel(true));   // split it over tp
///   auto dp = fsdp::DataParallelMeshDims().shard("dp");
///   for (auto& block : model->blocks()) fsdp::fully_shard(block, fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(dp));
///   fsdp::fully_shard(model, fsdp::FullyShardOptions().mesh(mesh).dp_mesh_dims(dp));
/// \endcode
///
/// A column-parallel Linear holds rows [r*out/tp, (r+1)*out/tp) of the weight (and bias) on tp
/// rank r: its input must be the same on every tp rank, its output is this rank's slice of the
/// output features; backward all-reduces the input's gradient over tp (each rank only has its
/// slice's contribution). A row-parallel Linear holds columns [r*in/tp, (r+1)*in/tp) of the
/// weight and the whole bias: its input is this rank's slice of the input features (what a
/// column-parallel layer produced), its forward all-reduces the partial products over tp, then
/// adds the bias once; backward needs no communication. A vocab-parallel Embedding holds rows
/// [r*V/tp, (r+1)*V/tp) of the table: it looks up the tokens in its rows, zeros the others and
/// all-reduces over tp in forward. Their parameters keep LibTorch's names (weight, bias) and are
/// registered as DTensors on the mesh (fsdp/dtensor_parameter.h): Shard(0) (column, embedding) /
/// Shard(1) (row) on tp, Replicate() on every other mesh dim.
///
/// Every collective here is on the tp dim's process group, issued in forward or backward in the
/// same order on every tp rank; nothing communicates at construction.
#pragma once

#include <fsdp/device_mesh.h>
#include <fsdp/process_group.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

namespace tp {

/// Identity in forward; all-reduces (sums) the gradient over `group` in backward. Put before a
/// column-parallel computation whose input is replicated over tp.
at::Tensor copy_to_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);
/// All-reduces (sums) over `group` in forward; identity in backward. Put after a row-parallel
/// computation whose output is a partial sum on each tp rank.
at::Tensor reduce_from_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);
/// All-gathers over `group` along the last dim in forward (rank order); backward keeps this
/// rank's slice of the gradient. Turns a column-parallel output (this rank's features) into the
/// whole one, the same on every tp rank.
at::Tensor gather_from_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group);

/// Where a tensor-parallel layer lives: a mesh and the name of its tp dim ("" for a 1-D mesh:
/// its one dim). Every other mesh dim holds copies (Replicate()).
struct TensorParallelMesh {
  /** @{ */
  /// Throws c10::Error when the mesh is empty, when `tp_dim` is empty on a mesh of several dims,
  /// or when it names no dim of `mesh`.
  TensorParallelMesh(DeviceMesh mesh, std::string tp_dim = "");
  /** @} */
  /** @{ */
  /// The mesh, the index of its tp dim, and this rank's tp group: its size, this rank's place
  /// in it, the group itself.
  const DeviceMesh& mesh() const { return mesh_; }
  int64_t tp_dim() const { return tp_dim_; }
  int64_t size() const { return mesh_.size(tp_dim_); }
  int64_t rank() const { return mesh_.get_local_rank(tp_dim_); }
  std::shared_ptr<ProcessGroup> group() const { return mesh_.get_group(tp_dim_); }
  /** @} */

 private:
  DeviceMesh mesh_;
  int64_t tp_dim_;
};

/// A Linear with its output features split over tp. It is a LinearImpl (same options, same
/// parameter names) holding this rank's rows; forward(x) = linear(copy_to_tp_region(x), w, b).
/// Built from the full layer (equal on every tp rank), whose weights it copies its rows from (like
/// LinearImpl, its constructor draws initial values from the global generator first).
/// out_features must be divisible by the tp size (throws c10::Error naming both otherwise).
class ColumnParallelLinearImpl : public torch::nn::LinearImpl {
 public:
  /** @{ */
  /// This rank's rows of `full` (see above), and forward(x) = linear(copy_to_tp_region(x), w, b).
  ColumnParallelLinearImpl(const torch::nn::LinearImpl& full, const TensorParallelMesh& tp);
  at::Tensor forward(const at::Tensor& x);
  /** @} */
  /// linear(x, w, b) alone, for an input that already went through copy_to_tp_region: several
  /// column-parallel layers reading one input share one all-reduce of its gradient that way
  /// (call_linears_on_shared_input). On any other input the input's gradient misses the other tp
  /// ranks' contributions.
  at::Tensor forward_in_tp_region(const at::Tensor& x);

  /// The tp group its communication runs on.
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  /// The first of the whole layer's output features this rank holds (its rows start there).
  int64_t first_output_feature() const { return first_output_feature_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  int64_t first_output_feature_ = 0;
};
TORCH_MODULE(ColumnParallelLinear);

/// A Linear with its input features split over tp: this rank's columns of the weight, the whole
/// bias; forward(x_local) = reduce_from_tp_region(x_local w_local^T) + b. in_features must be
/// divisible by the tp size.
class RowParallelLinearImpl : public torch::nn::LinearImpl {
 public:
  /** @{ */
  /// This rank's columns of `full` (see above), and forward(x_local).
  RowParallelLinearImpl(const torch::nn::LinearImpl& full, const TensorParallelMesh& tp);
  at::Tensor forward(const at::Tensor& x);
  /** @} */

 private:
  std::shared_ptr<ProcessGroup> group_;
};
TORCH_MODULE(RowParallelLinear);

/// An Embedding with its rows (the vocabulary) split over tp: this rank's rows [first_row(),
/// first_row() + V / tp) of the table. forward(tokens) looks up the tokens among its rows, zeros
/// the rows of the others and all-reduces the result over tp, so every tp rank gets the whole
/// embedding; backward needs no communication (each rank's rows get the gradient of their tokens).
/// Tokens must be the same on every tp rank and in [0, V) (checked). num_embeddings must be
/// divisible by the tp size; padding_idx and max_norm are refused (errors naming them).
class VocabParallelEmbeddingImpl : public torch::nn::EmbeddingImpl {
 public:
  /** @{ */
  /// This rank's rows of `full` (see above), forward(tokens), and the first vocabulary row it
  /// holds.
  VocabParallelEmbeddingImpl(const torch::nn::EmbeddingImpl& full, const TensorParallelMesh& tp);
  at::Tensor forward(const at::Tensor& tokens);
  int64_t first_row() const { return first_row_; }
  /** @} */

 private:
  std::shared_ptr<ProcessGroup> group_;
  int64_t first_row_ = 0;
  int64_t vocab_size_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

/// Calls `linear` through fsdp::call with the forward of its actual class: a ColumnParallelLinear
/// or RowParallelLinear put in place of a torch::nn::Linear member runs its own forward (LinearImpl's
/// forward is not virtual). Model code calls its Linear members through this.
at::Tensor call_linear(const torch::nn::Linear& linear, const at::Tensor& x);
/// call_linear for several Linear members reading the same input x (the attention's wq, wk and
/// wv). When all are column-parallel on one tp group, x goes through copy_to_tp_region once and
/// each layer through forward_in_tp_region: the input's gradient, summed over the layers by
/// autograd, is all-reduced over tp once (Megatron's "f" before its fused QKV projection) instead
/// of once per layer. Otherwise each is call_linear(layer, x). Returns the outputs in order.
std::vector<at::Tensor> call_linears_on_shared_input(const std::vector<torch::nn::Linear>& linears,
                                                     const at::Tensor& x);
/// The same for Embedding members: a VocabParallelEmbedding runs its own forward.
at::Tensor call_embedding(const torch::nn::Embedding& embedding, const at::Tensor& tokens);

// ------------------------------------------------------------------ logits split by vocabulary

/// Which part of the vocabulary a rank's logits (or output-head rows) hold: [start, start + size)
/// of the whole vocabulary, the other parts on the other ranks of `group`, in rank order.
struct VocabSlice {
  int64_t start = 0;                    ///< the first vocabulary entry of this rank's part
  int64_t size = 0;                     ///< the entries it holds
  std::shared_ptr<ProcessGroup> group;  ///< the tp group the parts are spread over
};
/// The slice an output head holds when it is a ColumnParallelLinear (a vocab-parallel head);
/// std::nullopt for a whole head.
std::optional<VocabSlice> vocab_slice_of(const torch::nn::Linear& head);

/// The mean cross-entropy of rows whose logits are split by vocabulary over slice.group, without
/// gathering them: local_logits [rows, slice.size] floating (this rank's columns of the whole
/// [rows, V] logits), targets int64 [rows] indices into the whole vocabulary (ignore_index: a row
/// that counts for nothing). Equals at::cross_entropy(whole_logits, targets) (mean over counted
/// rows) up to float rounding, on every rank of the group; the gradient of local_logits is this
/// rank's columns of the whole logits' gradient. Collective over slice.group, in forward only:
/// two all-reduces of the rows' statistics (combine_vocab_parallel_rows). Keeps local_logits and
/// 4 bytes a row for backward, which allocates one buffer of local_logits' size. Throws c10::Error
/// for mismatched shapes.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        const VocabSlice& slice, int64_t ignore_index = -100);
/// Where each row's target falls among the vocabulary rows [first, first + size) that a head (or
/// a vocab-parallel rank's slice of it) holds: `here` (bool [rows]) and `column` (int64 [rows],
/// the target's column there; 0 where it is not, so that gather and scatter stay in range).
struct TargetColumns {
  at::Tensor here;    ///< bool [rows]: the target is among the rows held
  at::Tensor column;  ///< int64 [rows]: its column there, 0 where it is not
};
/// The TargetColumns of `targets` for the rows [first, first + size). No communication.
TargetColumns target_columns(const at::Tensor& targets, int64_t first, int64_t size);
/// The whole vocabulary's log-sum-exp and target logit of each row from this rank's: in place,
/// `logsumexp` (fp32 [rows], of this rank's logits) becomes the whole rows', and `target_logit`
/// (fp32 [rows], the target's logit where this rank holds the target, else 0) the target's logit
/// wherever it is. Two all-reduces over `group`: the max of the ranks' log-sum-exps, then the sum
/// of exp(log-sum-exp - max) and of the target logits, as one tensor (Megatron's max trick, on each
/// rank's log-sum-exp rather than its raw maximum, so a rank's logits are read in one pass).
/// Called inside the forward of autograd functions (no autograd of its own).
void combine_vocab_parallel_rows(at::Tensor& logsumexp, at::Tensor& target_logit, ProcessGroup& group);

/// Registers every parameter of `model` that is not yet a DTensor (fsdp/dtensor_parameter.h) or
/// sharded by fully_shard as whole on every rank of tp.mesh() (Replicate() on every dim): what a
/// model's tensor-parallel plan leaves unsplit (fsdp/models/parallelize.h). No communication.
void register_replicated(torch::nn::Module& model, const TensorParallelMesh& tp);

}  // namespace tp
}  // namespace fsdp
