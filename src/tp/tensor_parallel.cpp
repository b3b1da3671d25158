// The tp collectives as autograd functions, and the column- and row-parallel Linear layers.
// The only communication of tensor parallelism: one all-reduce per region boundary, on the tp
// dim's group, in forward (row-parallel output) or backward (column-parallel input gradient).
#include <fsdp/tensor_parallel.h>

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

TensorParallelMesh::TensorParallelMesh(DeviceMesh mesh, std::string tp_dim) : mesh_(std::move(mesh)) {
  TORCH_CHECK(mesh_.valid(), "fsdp::tp::TensorParallelMesh: the mesh handle is empty; build one with "
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
    : torch::nn::LinearImpl(local_options(full, tp.size(), /*split_out=*/true)), group_(tp.group()) {
  // The base constructor initialised random values; the full layer's replace them.
  take_piece(weight, full.weight, 0, tp);
  if (bias.defined()) take_piece(bias, full.bias, 0, tp);
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return torch::nn::functional::linear(copy_to_tp_region(x, group_), weight, bias);
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

at::Tensor call_linear(const torch::nn::Linear& linear, const at::Tensor& x) {
  if (auto column = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(linear.ptr())) return fsdp::call(column, x);
  if (auto row = std::dynamic_pointer_cast<RowParallelLinearImpl>(linear.ptr())) return fsdp::call(row, x);
  std::shared_ptr<torch::nn::LinearImpl> plain = linear.ptr();
  return fsdp::call(plain, x);
}

}  // namespace tp
}  // namespace fsdp
