// The registry behind fsdp/dtensor_parameter.h: TensorImpl -> layout, with a weak reference
// that tells a live entry from a dead tensor whose address was reused.
#include <fsdp/dtensor_parameter.h>

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

namespace fsdp {
namespace {

struct Layout {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  DeviceMesh mesh;
  std::vector<Placement> placements;
  std::vector<int64_t> global_shape;
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, Layout> by_tensor;

  void drop_expired() {
    for (auto it = by_tensor.begin(); it != by_tensor.end();) {
      it = it->second.tensor.expired() ? by_tensor.erase(it) : std::next(it);
    }
  }
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: parameters may outlive static teardown
  return *r;
}

}  // namespace

void register_dtensor_parameter(const at::Tensor& param, const DeviceMesh& mesh, std::vector<Placement> placements,
                                std::vector<int64_t> global_shape) {
  TORCH_CHECK(param.defined(), "fsdp::register_dtensor_parameter: the tensor is undefined");
  // Validates the placements against the mesh and the local shape against the global one.
  const DTensor checked = DTensor::from_local(param, mesh, std::move(placements), std::move(global_shape));
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.drop_expired();
  r.by_tensor.insert_or_assign(param.unsafeGetTensorImpl(),
                               Layout{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()),
                                      checked.device_mesh(), checked.placements(), checked.sizes()});
}

std::optional<DTensor> dtensor_parameter(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_tensor.find(param.unsafeGetTensorImpl());
  if (it == r.by_tensor.end() || it->second.tensor.expired()) return std::nullopt;
  return DTensor::from_local(param, it->second.mesh, it->second.placements, it->second.global_shape);
}

}  // namespace fsdp
