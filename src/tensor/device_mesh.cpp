// DeviceMesh: rank layout arithmetic and the per-dimension process groups.
#include <fsdp/device_mesh.h>

#include "src/tensor/default_mesh.h"

#include <fsdp/device.h>
#include <fsdp/distributed.h>

#include "src/device/device_ops.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>

namespace fsdp {

struct DeviceMesh::Impl {
  std::string device_type;
  std::vector<int64_t> shape;
  std::vector<std::string> dim_names;
  std::vector<int64_t> ranks;                         // world ranks, row-major over `shape`
  std::vector<int64_t> coordinate;                    // this rank's
  std::vector<std::shared_ptr<ProcessGroup>> groups;  // one per dim
  c10::Device device{c10::DeviceType::CPU};           // this rank's device
};

const DeviceMesh::Impl& DeviceMesh::checked_impl() const {
  TORCH_CHECK(impl_, "fsdp::DeviceMesh: this mesh handle is empty; build one with fsdp::init_device_mesh()");
  return *impl_;
}

namespace {

void check_device_type(const std::string& device_type) {
  TORCH_CHECK(device_type == "cpu" || device_type == "cuda", "fsdp::init_device_mesh: device type '", device_type,
              "' is not supported; use \"cpu\" or \"cuda\"");
  if (device_type == "cuda") {
    TORCH_CHECK(cuda_available(), "fsdp::init_device_mesh(\"cuda\", ...): ", cuda_unavailable_reason(),
                "; use \"cpu\"");
  }
}

// The backend of a "cuda" mesh's groups: NCCL, or Gloo with the tensors staged through the host
// when FSDP_CUDA_BACKEND=gloo (several ranks sharing one GPU, which NCCL refuses).
std::string cuda_mesh_backend() {
  const char* v = std::getenv("FSDP_CUDA_BACKEND");
  const std::string name = v ? v : "nccl";
  TORCH_CHECK(name == "nccl" || name == "gloo", "FSDP_CUDA_BACKEND='", name,
              "' is not a backend for a \"cuda\" mesh; use nccl (the default) or gloo (staged through host memory)");
  return name == "nccl" ? "nccl" : "";
}

// This rank's GPU: its local rank modulo the GPUs it sees, as PyTorch's init_device_mesh picks
// it; made the current device, so that NCCL and FSDP's allocations use it.
c10::Device select_cuda_device() {
  const int count = cuda_device_count();
  const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(rendezvous_info().local_rank % count));
  device::ops_for(device).set_current_device(device);
  return device;
}

void check_dim(int64_t dim, int64_t ndim) {
  TORCH_CHECK(dim >= 0 && dim < ndim, "fsdp::DeviceMesh: dim ", dim, " out of range for a ", ndim, "-D mesh");
}

}  // namespace

DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                            const std::vector<std::string>& dim_names) {
  check_device_type(device_type);
  TORCH_CHECK(!shape.empty(), "fsdp::init_device_mesh: the mesh shape is empty");
  int64_t total = 1;
  for (int64_t s : shape) {
    TORCH_CHECK(s >= 1, "fsdp::init_device_mesh: mesh dims must be >= 1, got ", s);
    total *= s;
  }
  const int world = get_world_size();
  TORCH_CHECK(total == world, "fsdp::init_device_mesh: a mesh of shape ", c10::IntArrayRef(shape), " has ", total,
              " ranks but the world has ", world);
  TORCH_CHECK(dim_names.empty() || dim_names.size() == shape.size(), "fsdp::init_device_mesh: ", dim_names.size(),
              " dim names for a ", shape.size(), "-D mesh");
  TORCH_CHECK(std::set<std::string>(dim_names.begin(), dim_names.end()).size() == dim_names.size(),
              "fsdp::init_device_mesh: dim names must be distinct");

  auto impl = std::make_shared<DeviceMesh::Impl>();
  impl->device_type = device_type;
  impl->device = device_type == "cuda" ? select_cuda_device() : c10::Device(c10::DeviceType::CPU);
  const std::string backend = device_type == "cuda" ? cuda_mesh_backend() : "";
  impl->shape = shape;
  impl->dim_names = dim_names;
  impl->ranks.resize(total);
  for (int64_t i = 0; i < total; ++i) impl->ranks[i] = i;

  // Row-major strides; this rank's coordinate.
  const int64_t nd = static_cast<int64_t>(shape.size());
  std::vector<int64_t> stride(nd, 1);
  for (int64_t d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];
  const int64_t me = get_rank();
  for (int64_t d = 0; d < nd; ++d) impl->coordinate.push_back((me / stride[d]) % shape[d]);

  // One group per dim: the ranks that differ from this one only along that dim.
  for (int64_t d = 0; d < nd; ++d) {
    const int64_t base = me - impl->coordinate[d] * stride[d];
    std::vector<int> members;
    for (int64_t i = 0; i < shape[d]; ++i) members.push_back(static_cast<int>(base + i * stride[d]));
    impl->groups.push_back(new_group(members, backend));
  }
  return DeviceMesh(std::move(impl));
}

const std::string& DeviceMesh::device_type() const { return checked_impl().device_type; }
c10::Device DeviceMesh::device() const { return checked_impl().device; }
int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(checked_impl().shape.size()); }
std::vector<int64_t> DeviceMesh::shape() const { return checked_impl().shape; }
const std::vector<std::string>& DeviceMesh::dim_names() const { return checked_impl().dim_names; }

int64_t DeviceMesh::size(int64_t dim) const {
  const Impl& m = checked_impl();
  if (dim < 0) return static_cast<int64_t>(m.ranks.size());
  check_dim(dim, ndim());
  return m.shape[dim];
}

at::Tensor DeviceMesh::mesh() const {
  const Impl& m = checked_impl();
  return at::tensor(m.ranks, at::kLong).view(m.shape);
}

std::vector<int64_t> DeviceMesh::coordinate() const { return checked_impl().coordinate; }

int64_t DeviceMesh::dim_index(const std::string& dim_name) const {
  const Impl& m = checked_impl();
  for (size_t i = 0; i < m.dim_names.size(); ++i) {
    if (m.dim_names[i] == dim_name) return static_cast<int64_t>(i);
  }
  std::ostringstream known;
  for (size_t i = 0; i < m.dim_names.size(); ++i) known << (i ? ", " : "") << "'" << m.dim_names[i] << "'";
  TORCH_CHECK(false, "fsdp::DeviceMesh: no dim named '", dim_name, "'; this mesh has ",
              m.dim_names.empty() ? std::string("unnamed dims") : known.str());
}

int64_t DeviceMesh::get_local_rank(int64_t dim) const {
  check_dim(dim, ndim());
  return impl_->coordinate[dim];
}
int64_t DeviceMesh::get_local_rank(const std::string& dim_name) const { return get_local_rank(dim_index(dim_name)); }

std::shared_ptr<ProcessGroup> DeviceMesh::get_group(int64_t dim) const {
  check_dim(dim, ndim());
  return impl_->groups[dim];
}
std::shared_ptr<ProcessGroup> DeviceMesh::get_group(const std::string& dim_name) const {
  return get_group(dim_index(dim_name));
}

DeviceMesh DeviceMesh::operator[](const std::string& dim_name) const {
  const int64_t d = dim_index(dim_name);
  const Impl& m = *impl_;
  if (m.shape.size() == 1) return *this;
  auto sub = std::make_shared<Impl>();
  sub->device_type = m.device_type;
  sub->device = m.device;
  sub->shape = {m.shape[d]};
  sub->dim_names = {dim_name};
  for (int r : m.groups[d]->global_ranks()) sub->ranks.push_back(r);
  sub->coordinate = {m.coordinate[d]};
  sub->groups = {m.groups[d]};
  return DeviceMesh(std::move(sub));
}

std::string DeviceMesh::str() const {
  const Impl& m = checked_impl();
  std::ostringstream s;
  s << "DeviceMesh('" << m.device_type << "', shape=" << c10::IntArrayRef(m.shape);
  if (!m.dim_names.empty()) {
    s << ", mesh_dim_names=(";
    for (size_t i = 0; i < m.dim_names.size(); ++i) s << (i ? ", " : "") << "'" << m.dim_names[i] << "'";
    s << (m.dim_names.size() == 1 ? ",)" : ")");
  }
  s << ")";
  return s.str();
}

namespace detail {

DeviceMesh default_world_mesh() {
  static std::mutex mu;
  static DeviceMesh mesh;
  static std::weak_ptr<ProcessGroup> made_for;  // the world group `mesh` was made in
  std::lock_guard<std::mutex> lock(mu);
  const std::shared_ptr<ProcessGroup> current = world();
  if (!mesh.valid() || made_for.lock() != current) {
    mesh = init_device_mesh("cpu", {current->size()});
    made_for = current;
  }
  return mesh;
}

}  // namespace detail
}  // namespace fsdp
