// The registry of device implementations, the CPU's implementation, loading the CUDA path, and
// fsdp/device.h.
//
// On the CPU every operation runs in program order on the host: there is one stream, events are
// always complete, and waits are no-ops. Byte copies are memcpy, and a storage is resized by
// ATen's CPU resize (what the CPU path used before this layer existed, so its speed is the same).
#include "src/device/device_ops.h"

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <dlfcn.h>

#include <array>
#include <cstring>
#include <mutex>
#include <string>

namespace fsdp {
namespace device {
namespace {

class CpuOps final : public DeviceOps {
 public:
  c10::DeviceType type() const override { return c10::DeviceType::CPU; }
  c10::Device current_device() override { return c10::Device(c10::DeviceType::CPU); }
  void set_current_device(c10::Device) override {}
  c10::Stream current_stream(c10::Device device) override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream side_stream(c10::Device device, bool) override { return current_stream(device); }
  c10::Stream exchange_stream(c10::Stream stream) override { return stream; }
  Event record(c10::Stream) override { return Event(); }
  void wait(c10::Stream, const Event&) override {}
  void synchronize(const Event&) override {}
  void copy_bytes(void* dst, const void* src, size_t nbytes) override {
    if (nbytes > 0) std::memcpy(dst, src, nbytes);
  }
  void zero_bytes(void* dst, size_t nbytes) override {
    if (nbytes > 0) std::memset(dst, 0, nbytes);
  }
  void resize_storage(c10::StorageImpl& storage, size_t nbytes) override {
    at::native::resize_bytes_cpu(&storage, nbytes);
  }
  bool can_pin_host_memory() const override { return false; }
  bool has_streams() const override { return false; }
  bool shares_host_memory() const override { return true; }
  at::Tensor to_host(const at::Tensor& t, at::ScalarType dtype, bool, bool) override { return t.to(dtype); }
  at::Tensor to_device(const at::Tensor& t, c10::Device, at::ScalarType dtype, bool) override { return t.to(dtype); }
  at::Tensor empty_like_on(const at::Tensor& like, c10::Device) override { return at::empty_like(like); }
  int device_count() const override { return 1; }
  DeviceMemoryStats memory_stats(c10::Device) override { return DeviceMemoryStats{}; }
  void reset_peak_memory(c10::Device) override {}
};

constexpr size_t kDeviceTypes = static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);

struct Registry {
  std::mutex mu;
  std::array<std::unique_ptr<DeviceOps>, kDeviceTypes> ops;
  Registry() { ops[static_cast<size_t>(c10::DeviceType::CPU)] = std::make_unique<CpuOps>(); }
};

Registry& registry() {
  static Registry r;
  return r;
}

// The folder of the library this code is in (libfsdp), where libfsdp_cuda sits beside it.
std::string this_library_folder() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&register_ops), &info) == 0 || info.dli_fname == nullptr) return "";
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash + 1);
}

// The CUDA path is the library libfsdp_cuda (built with -DFSDP_USE_CUDA=ON), loaded once, when
// libfsdp is loaded (cuda_path_loader.cpp) or else when a CUDA device is first asked for; its
// static initialisers register its DeviceOps and the NCCL group factory, unless it says why not
// (fsdp_cuda_path_error). Returns "" once it is loaded, else why it is not. Called without the
// registry's lock held: loading it calls register_ops.
bool g_cuda_path_refused = false;  // loaded, but it registered nothing (fsdp_cuda_path_error)

const std::string& load_cuda_path() {
  static const std::string why_not = [] {
    const std::string path = this_library_folder() + "libfsdp_cuda.so";
    void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (library == nullptr) {
      const char* error = dlerror();
      return std::string(error ? error : ("dlopen of " + path + " failed").c_str());
    }
    using ErrorFn = const char* (*)();
    const auto error_of = reinterpret_cast<ErrorFn>(dlsym(library, "fsdp_cuda_path_error"));
    std::string error = error_of ? error_of() : "";
    g_cuda_path_refused = !error.empty();
    return error;
  }();
  return why_not;
}

}  // namespace

void register_ops(std::unique_ptr<DeviceOps> ops) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.ops[static_cast<size_t>(ops->type())] = std::move(ops);
}

bool has_ops_for(c10::DeviceType type) {
  if (type == c10::DeviceType::CUDA) load_cuda_path();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.ops[static_cast<size_t>(type)] != nullptr;
}

DeviceOps& ops_for(c10::DeviceType type) {
  const std::string why_not = type == c10::DeviceType::CUDA ? load_cuda_path() : std::string();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  DeviceOps* ops = r.ops[static_cast<size_t>(type)].get();
  TORCH_CHECK(ops != nullptr, "fsdp: this build of fsdp-cpp has no ", c10::DeviceTypeName(type), " support",
              why_not.empty() ? std::string() : " (" + why_not + ")",
              "; rebuild it with -DFSDP_USE_CUDA=ON against a CUDA LibTorch for CUDA devices, or use \"cpu\"");
  return *ops;
}

std::string load_cuda_path_error() { return load_cuda_path(); }

}  // namespace device

bool built_with_cuda() { return device::has_ops_for(c10::DeviceType::CUDA); }

int cuda_device_count() { return built_with_cuda() ? device::ops_for(c10::DeviceType::CUDA).device_count() : 0; }

bool cuda_available() { return cuda_device_count() > 0; }

std::string cuda_unavailable_reason() {
  if (!built_with_cuda()) {
    const std::string why = device::load_cuda_path_error();
    if (device::g_cuda_path_refused) return "the CUDA path of this build did not start: " + why;
    return "this build of fsdp-cpp has no CUDA path (" + why + "; configure with -DFSDP_USE_CUDA=ON)";
  }
  if (cuda_device_count() == 0) return "this machine has no CUDA device (or no driver for one)";
  return "";
}

DeviceMemoryStats device_memory_stats(c10::Device device) {
  if (device.is_cpu()) return DeviceMemoryStats{};
  return device::ops_for(device).memory_stats(device);
}

void reset_peak_device_memory(c10::Device device) {
  if (!device.is_cpu()) device::ops_for(device).reset_peak_memory(device);
}

}  // namespace fsdp
