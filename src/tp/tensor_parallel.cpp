// The tp collectives as autograd functions, the column- and row-parallel Linear layers and the
// vocab-parallel Embedding. The communication of tensor parallelism's layers: one all-reduce per
// region boundary, on the tp dim's group, in forward (row-parallel output, vocab-parallel
// embedding) or backward (column-parallel input gradient); an all-gather where a caller wants a
// column-parallel output whole.
#include <fsdp/tensor_parallel.h>

#include "src/composable/registry.h"

#include <fsdp/call.h>
#include <fsdp/dtensor_parameter.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/functional/linear.h>

namespace fsdp {
namespace tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels through the autograd context as a capsule.
struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(std::shared_ptr<ProcessGroup> g) : group(std::move(g)) {}
  std::shared_ptr<ProcessGroup> group;
};

ProcessGroup& group_of(AutogradContext* ctx) {
  return *c10::static_intrusive_pointer_cast<GroupCapsule>(ctx->saved_data["group"].toCapsule())->group;
}

// A sum over the group into a new tensor (the input may be saved by autograd or shared).
at::Tensor all_reduced(const at::Tensor& t, ProcessGroup& group) {
  at::Tensor out = t.contiguous().clone();
  group.all_reduce(out, ReduceOp::kSum)->wait();
  return out;
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<GroupCapsule>& g) {
    ctx->saved_data["group"] = at::IValue::make_capsule(g);
    return x.view_as(x);  // a new tensor object for autograd; no copy
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0].defined() ? all_reduced(grads[0], group_of(ctx)) : grads[0], at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<GroupCapsule>& g) {
    (void)ctx;
    return all_reduced(x, *g->group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const c10::intrusive_ptr<GroupCapsule>& g) {
    ProcessGroup& group = *g->group;
    ctx->saved_data["rank"] = static_cast<int64_t>(group.rank());
    ctx->saved_data["width"] = x.size(-1);
    // Rank-major pieces, then each rank's piece as the next columns of the last dim.
    const at::Tensor local = x.contiguous();
    at::Tensor pieces = at::empty({group.size(), local.numel()}, local.options());
    group.all_gather_into(pieces, local)->wait();
    std::vector<int64_t> shape = local.sizes().vec();
    shape.insert(shape.begin(), group.size());
    return at::cat(pieces.view(shape).unbind(0), -1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t rank = ctx->saved_data["rank"].toInt(), width = ctx->saved_data["width"].toInt();
    return {grads[0].narrow(-1, rank * width, width), at::Tensor()};
  }
};

void check_group(const std::shared_ptr<ProcessGroup>& group, const char* what) {
  TORCH_CHECK(group != nullptr, "fsdp::tp::", what, ": the tp process group is null");
}

torch::nn::LinearOptions local_options(const torch::nn::LinearImpl& full, int64_t tp, bool split_out) {
  torch::nn::LinearOptions o = full.options;
  const int64_t features = split_out ? o.out_features() : o.in_features();
  TORCH_CHECK(features % tp == 0, "fsdp::tp: a ", split_out ? "column" : "row", "-parallel Linear splits its ",
              split_out ? "out_features" : "in_features", "=", features, " over tp=", tp,
              ", which does not divide it; choose a tp size that divides ", features);
  if (split_out) {
    o.out_features(features / tp);
  } else {
    o.in_features(features / tp);
  }
  return o;
}

// The placements of a tensor split along `tensor_dim` over the tp dim (Replicate() elsewhere),
// or whole (tensor_dim < 0).
std::vector<Placement> tp_placements(const TensorParallelMesh& tp, int64_t tensor_dim) {
  std::vector<Placement> p(tp.mesh().ndim(), Replicate());
  if (tensor_dim >= 0) p[tp.tp_dim()] = Shard(tensor_dim);
  return p;
}

// Copies this rank's piece of `full` along `dim` into `local` and registers the layout.
void take_piece(at::Tensor& local, const at::Tensor& full, int64_t dim, const TensorParallelMesh& tp) {
  at::NoGradGuard no_grad;
  if (dim >= 0) {
    const int64_t n = full.size(dim) / tp.size();
    local.copy_(full.narrow(dim, tp.rank() * n, n));
  } else {
    local.copy_(full);
  }
  register_dtensor_parameter(local, tp.mesh(), tp_placements(tp, dim), full.sizes().vec());
}

}  // namespace

at::Tensor copy_to_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  check_group(group, "copy_to_tp_region");
  if (group->size() == 1) return x;
  return CopyToRegion::apply(x, c10::make_intrusive<GroupCapsule>(group));
}

at::Tensor reduce_from_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  check_group(group, "reduce_from_tp_region");
  if (group->size() == 1) return x;
  return ReduceFromRegion::apply(x, c10::make_intrusive<GroupCapsule>(group));
}

at::Tensor gather_from_tp_region(const at::Tensor& x, const std::shared_ptr<ProcessGroup>& group) {
  check_group(group, "gather_from_tp_region");
  TORCH_CHECK(x.dim() >= 1,
              "fsdp::tp::gather_from_tp_region: x is a 0-dim tensor; give one with a last dim to gather along");
  if (group->size() == 1) return x;
  return GatherFromRegion::apply(x, c10::make_intrusive<GroupCapsule>(group));
}

TensorParallelMesh::TensorParallelMesh(DeviceMesh mesh, std::string tp_dim) : mesh_(std::move(mesh)) {
  TORCH_CHECK(mesh_.valid(),
              "fsdp::tp::TensorParallelMesh: the mesh handle is empty; build one with "
              "fsdp::init_device_mesh()");
  if (tp_dim.empty()) {
    TORCH_CHECK(mesh_.ndim() == 1, "fsdp::tp::TensorParallelMesh: the mesh ", mesh_.str(), " has ", mesh_.ndim(),
                " dims; name the tensor-parallel one (e.g. TensorParallelMesh(mesh, \"tp\"))");
    tp_dim_ = 0;
  } else {
    tp_dim_ = mesh_.dim_index(tp_dim);
  }
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const torch::nn::LinearImpl& full, const TensorParallelMesh& tp)
    : torch::nn::LinearImpl(local_options(full, tp.size(), /*split_out=*/true)),
      group_(tp.group()),
      first_output_feature_(tp.rank() * options.out_features()) {
  // The base constructor initialised random values; the full layer's replace them.
  take_piece(weight, full.weight, 0, tp);
  if (bias.defined()) take_piece(bias, full.bias, 0, tp);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return forward_in_tp_region(copy_to_tp_region(x, group_));
}

at::Tensor ColumnParallelLinearImpl::forward_in_tp_region(const at::Tensor& x) {
  return torch::nn::functional::linear(x, weight, bias);
}

RowParallelLinearImpl::RowParallelLinearImpl(const torch::nn::LinearImpl& full, const TensorParallelMesh& tp)
    : torch::nn::LinearImpl(local_options(full, tp.size(), /*split_out=*/false)), group_(tp.group()) {
  take_piece(weight, full.weight, 1, tp);
  if (bias.defined()) take_piece(bias, full.bias, -1, tp);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor out = reduce_from_tp_region(torch::nn::functional::linear(x, weight), group_);
  return bias.defined() ? out + bias : out;
}

namespace {

torch::nn::EmbeddingOptions local_options(const torch::nn::EmbeddingImpl& full, int64_t tp) {
  torch::nn::EmbeddingOptions o = full.options;
  TORCH_CHECK(!o.padding_idx().has_value() && !o.max_norm().has_value(),
              "fsdp::tp: a vocab-parallel Embedding does not support padding_idx or max_norm (the full Embedding "
              "sets ",
              o.padding_idx().has_value() ? "padding_idx" : "max_norm", "); keep such an Embedding whole");
  TORCH_CHECK(o.num_embeddings() % tp == 0,
              "fsdp::tp: a vocab-parallel Embedding splits its num_embeddings=", o.num_embeddings(), " over tp=", tp,
              ", which does not divide it; choose a tp size that divides ", o.num_embeddings(),
              " or keep the embedding whole");
  o.num_embeddings(o.num_embeddings() / tp);
  return o;
}

}  // namespace

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(const torch::nn::EmbeddingImpl& full,
                                                       const TensorParallelMesh& tp)
    : torch::nn::EmbeddingImpl(local_options(full, tp.size())),
      group_(tp.group()),
      first_row_(tp.rank() * options.num_embeddings()),
      vocab_size_(full.options.num_embeddings()) {
  take_piece(weight, full.weight, 0, tp);
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& tokens) {
  // Every rank would otherwise zero an out-of-range token's row silently (a whole Embedding throws).
  if (tokens.numel() > 0) {
    const auto [lowest, highest] = at::aminmax(tokens);
    TORCH_CHECK(lowest.item<int64_t>() >= 0 && highest.item<int64_t>() < vocab_size_,
                "fsdp::tp::VocabParallelEmbedding: token ids must be in [0, ", vocab_size_, "), got ",
                lowest.item<int64_t>(), " .. ", highest.item<int64_t>());
  }
  const int64_t rows = weight.size(0);
  const at::Tensor elsewhere = (tokens < first_row_).logical_or_(tokens >= first_row_ + rows);
  const at::Tensor local = (tokens - first_row_).masked_fill_(elsewhere, 0);
  // Zeroed out of place: the zeroed positions then send no gradient to row 0.
  const at::Tensor mine = at::embedding(weight, local).masked_fill(elsewhere.unsqueeze(-1), 0.0);
  return reduce_from_tp_region(mine, group_);
}

at::Tensor call_linear(const torch::nn::Linear& linear, const at::Tensor& x) {
  if (auto column = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(linear.ptr())) return fsdp::call(column, x);
  if (auto row = std::dynamic_pointer_cast<RowParallelLinearImpl>(linear.ptr())) return fsdp::call(row, x);
  std::shared_ptr<torch::nn::LinearImpl> plain = linear.ptr();
  return fsdp::call(plain, x);
}

std::vector<at::Tensor> call_linears_on_shared_input(const std::vector<torch::nn::Linear>& linears,
                                                     const at::Tensor& x) {
  std::vector<std::shared_ptr<ColumnParallelLinearImpl>> columns;
  for (const auto& linear : linears) {
    auto column = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(linear.ptr());
    if (!column || (!columns.empty() && column->group() != columns.front()->group())) break;
    columns.push_back(std::move(column));
  }
  std::vector<at::Tensor> out;
  if (!linears.empty() && columns.size() == linears.size()) {
    const at::Tensor shared = copy_to_tp_region(x, columns.front()->group());
    for (auto& column : columns)
      out.push_back(fsdp::call_method(column, &ColumnParallelLinearImpl::forward_in_tp_region, shared));
  } else {
    for (const auto& linear : linears) out.push_back(call_linear(linear, x));
  }
  return out;
}

at::Tensor call_embedding(const torch::nn::Embedding& embedding, const at::Tensor& tokens) {
  if (auto split = std::dynamic_pointer_cast<VocabParallelEmbeddingImpl>(embedding.ptr()))
    return fsdp::call(split, tokens);
  std::shared_ptr<torch::nn::EmbeddingImpl> plain = embedding.ptr();
  return fsdp::call(plain, tokens);
}

std::optional<VocabSlice> vocab_slice_of(const torch::nn::Linear& head) {
  auto column = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(head.ptr());
  if (!column) return std::nullopt;
  return VocabSlice{column->first_output_feature(), column->options.out_features(), column->group()};
}

namespace {

// Whether `p` is a shard that fully_shard registered (answered by the composable registry, so
// that tp needs nothing of fsdp).
bool is_fsdp_shard(const at::Tensor& p) {
  auto owner = composable::managed_parameter(p);
  return owner && owner->api == composable::Api::kFullyShard && owner->role == composable::ParamRole::kSharded;
}

}  // namespace

// What a model's plan leaves unsplit: whole on every rank of the mesh.
void register_replicated(torch::nn::Module& model, const TensorParallelMesh& tp) {
  const std::vector<Placement> whole(tp.mesh().ndim(), Replicate());
  for (const auto& p : model.parameters()) {
    // A block already sharded by fully_shard registers its shards here, whose unsharded
    // tensors carry the records; only parameters outside the blocks get one now.
    if (is_fsdp_shard(p) || dtensor_parameter(p)) continue;
    register_dtensor_parameter(p, tp.mesh(), whole, p.sizes().vec());
  }
}

}  // namespace tp
}  // namespace fsdp
