// The CUDA implementation of the device layer (device_ops.h), built with -DFSDP_USE_CUDA=ON.
//
// Streams are c10's CUDA streams: the side streams come from c10's pool, as torch.cuda.Stream()
// does, with high priority for FSDP's communication streams. Events are ATen's CUDAEvent without
// timing. Storage resizes allocate through the storage's own allocator (the caching allocator),
// on the stream current at that moment, which is the stream whose pool gets the block back when
// it is freed: FSDP resizes unsharded parameters only on the compute stream.
//
// For tests only: FSDP_CUDA_SIDE_STREAM_DELAY_CYCLES (below) delays the side streams, so that a
// missing wait for one of them changes results deterministically.
#include "src/device/device_ops.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_set>

namespace fsdp {
namespace device {
namespace {

c10::DeviceIndex index_of(c10::Device device) {
  return device.has_index() ? device.index() : c10::cuda::current_device();
}

at::cuda::CUDAEvent& cuda_event(const Event& event) { return *static_cast<at::cuda::CUDAEvent*>(event.impl()); }

// A testing knob, as FSDP2's tests use torch.cuda._sleep: FSDP_CUDA_SIDE_STREAM_DELAY_CYCLES=N
// (read once per process) queues at::cuda::sleep(N), a kernel spinning N GPU clock cycles (about
// N / 1.7e6 ms on an H100), on a side stream each time it becomes the current stream, so that
// everything then issued on it (copies, casts, collectives, staging copies) runs late. A stream
// that reads such work without waiting for its event then reads stale or unwritten memory every
// time, instead of only under unlucky timing. Unset or 0: nothing is queued. Not for training.
class SideStreamDelay {
 public:
  SideStreamDelay() : cycles_(parse(std::getenv("FSDP_CUDA_SIDE_STREAM_DELAY_CYCLES"))) {}
  void note_side_stream(c10::Stream stream) {
    if (cycles_ == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    side_streams_.insert(stream);
  }
  // Called once `stream` is the current stream.
  void on_current(c10::Stream stream) {
    if (cycles_ == 0) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (side_streams_.count(stream) == 0) return;
    }
    at::cuda::sleep(cycles_);
  }

 private:
  static int64_t parse(const char* text) {
    if (text == nullptr || *text == '\0') return 0;
    char* end = nullptr;
    const long long cycles = std::strtoll(text, &end, 10);
    TORCH_CHECK(end != text && *end == '\0' && cycles >= 0,
                "FSDP_CUDA_SIDE_STREAM_DELAY_CYCLES must be a count of "
                "GPU clock cycles (a non-negative integer), but is '",
                text, "'; unset it outside tests");
    return cycles;
  }
  const int64_t cycles_;
  std::mutex mutex_;
  std::unordered_set<c10::Stream> side_streams_;
};

SideStreamDelay& side_stream_delay() {
  static SideStreamDelay delay;
  return delay;
}

class CudaOps final : public DeviceOps {
 public:
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device current_device() override { return c10::Device(c10::DeviceType::CUDA, c10::cuda::current_device()); }
  void set_current_device(c10::Device device) override { c10::cuda::set_device(index_of(device)); }

  c10::Stream current_stream(c10::Device device) override {
    return c10::cuda::getCurrentCUDAStream(index_of(device)).unwrap();
  }
  c10::Stream side_stream(c10::Device device, bool high_priority) override {
    const c10::Stream stream = c10::cuda::getStreamFromPool(high_priority, index_of(device)).unwrap();
    side_stream_delay().note_side_stream(stream);
    return stream;
  }
  c10::Stream exchange_stream(c10::Stream stream) override {
    const c10::Stream previous = c10::cuda::getCurrentCUDAStream(stream.device_index()).unwrap();
    c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream(stream));
    side_stream_delay().on_current(stream);
    return previous;
  }
  Event record(c10::Stream stream) override {
    auto event = std::make_shared<at::cuda::CUDAEvent>(cudaEventDisableTiming);
    event->record(c10::cuda::CUDAStream(stream));
    return Event(std::move(event));
  }
  void wait(c10::Stream waiter, const Event& event) override {
    if (!event.empty()) cuda_event(event).block(c10::cuda::CUDAStream(waiter));
  }
  void synchronize(const Event& event) override {
    if (!event.empty()) cuda_event(event).synchronize();
  }

  void copy_bytes(void* dst, const void* src, size_t nbytes) override {
    if (nbytes == 0) return;
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, c10::cuda::getCurrentCUDAStream()));
  }
  void zero_bytes(void* dst, size_t nbytes) override {
    if (nbytes == 0) return;
    C10_CUDA_CHECK(cudaMemsetAsync(dst, 0, nbytes, c10::cuda::getCurrentCUDAStream()));
  }
  void resize_storage(c10::StorageImpl& storage, size_t nbytes) override {
    if (nbytes == storage.nbytes()) return;
    c10::cuda::CUDAGuard guard(storage.device());
    c10::Allocator* allocator = storage.allocator() ? storage.allocator() : c10::cuda::CUDACachingAllocator::get();
    storage.set_data_ptr_noswap(nbytes > 0 ? allocator->allocate(nbytes) : c10::DataPtr(nullptr, storage.device()));
    storage.set_nbytes(nbytes);
  }
  bool can_pin_host_memory() const override { return true; }
  bool has_streams() const override { return true; }
  bool shares_host_memory() const override { return false; }
  at::Tensor to_host(const at::Tensor& t, at::ScalarType dtype, bool pinned, bool non_blocking) override {
    return t.to(at::TensorOptions().device(c10::kCPU).dtype(dtype).pinned_memory(pinned), non_blocking);
  }
  at::Tensor to_device(const at::Tensor& t, c10::Device device, at::ScalarType dtype, bool non_blocking) override {
    return t.to(device, dtype, non_blocking);
  }
  at::Tensor empty_like_on(const at::Tensor& like, c10::Device device) override {
    return at::empty_like(like, like.options().device(device));
  }

  int device_count() const override { return c10::cuda::device_count(); }
  DeviceMemoryStats memory_stats(c10::Device device) override {
    // Index 0 is StatType::AGGREGATE (all pools), whose namespace moved between releases.
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index_of(device));
    const auto& allocated = stats.allocated_bytes[0];
    const auto& reserved = stats.reserved_bytes[0];
    return DeviceMemoryStats{allocated.current, allocated.peak, reserved.current, reserved.peak};
  }
  void reset_peak_memory(c10::Device device) override {
    c10::cuda::CUDACachingAllocator::resetPeakStats(index_of(device));
  }
};

// ATen asks once per process whether it has CUDA (getCUDAHooks() keeps its first answer); asked
// before libtorch_cuda was loaded, it answers no for good, and pinned memory, the CUDA
// generators and the autograd engine's device threads then never work. libfsdp loads this
// library when it is itself loaded, before main (cuda_path_loader.cpp), so that only a process
// that deferred it (FSDP_CUDA_PATH=lazy) or loaded libfsdp late (dlopen) after touching ATen can
// meet this; it then gets this error instead of failures far from their cause.
std::string why_aten_has_no_cuda() {
  if (at::detail::getCUDAHooks().hasCUDART()) return "";
  return "libfsdp_cuda was loaded after ATen had decided that this process has no CUDA: something asked it "
         "(torch::manual_seed, at::hasCUDA, pin_memory, ...) first, and ATen keeps its first answer. Unset "
         "FSDP_CUDA_PATH=lazy (libfsdp then loads its CUDA path when it is loaded), link the program with libfsdp "
         "instead of loading it later with dlopen, or call fsdp::cuda_available() before anything touches ATen";
}

std::string& load_error() {
  static std::string error;
  return error;
}

// Registered when the library is loaded, unless ATen cannot run CUDA in this process.
const bool registered = [] {
  load_error() = why_aten_has_no_cuda();
  if (load_error().empty()) register_ops(std::make_unique<CudaOps>());
  return true;
}();

}  // namespace
}  // namespace device
}  // namespace fsdp

// Read by the loader (device_ops.cpp) after it loaded this library: why it registered nothing,
// "" when it did.
extern "C" const char* fsdp_cuda_path_error() { return fsdp::device::load_error().c_str(); }

// For the CUDA tests, which include no CUDA header and find these with dlsym: a new instance of
// these operations, for a test to wrap, and a spin of `cycles` GPU clock cycles queued on the
// current stream, which holds a stream back so that a missing wait changes a result.
extern "C" fsdp::device::DeviceOps* fsdp_cuda_testing_new_ops() { return new fsdp::device::CudaOps(); }
extern "C" void fsdp_cuda_testing_sleep(int64_t cycles) { at::cuda::sleep(cycles); }
