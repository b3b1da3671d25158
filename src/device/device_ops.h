// device_ops.h — everything the layers above do differently on an accelerator, behind one small
// interface: streams, events, byte copies into buffers laid out by hand, resizing a storage in
// place, and pinned host memory. One implementation per device type registers itself:
// the CPU's (device_ops.cpp), where streams are one program order and every wait is a no-op,
// and CUDA's (cuda_device_ops.cpp, in libfsdp_cuda: built with -DFSDP_USE_CUDA=ON, loaded when
// libfsdp is, or with FSDP_CUDA_PATH=lazy when a CUDA device is first asked for). Code above this layer never
// includes a CUDA header and never tests for CUDA with #ifdef: it asks ops_for(device).
//
// Streams are c10's device-generic handles (c10::Stream); an Event is a point in a stream's
// work that another stream (or the host) can wait for.
//
// The CPU has a checking mode (FSDP_DEVICE_CHECK=1, stream_check.h): its streams and events
// are modelled, host memory is told apart from "device" memory, and every operation is checked
// for the order a GPU would need, so that a missing wait shows on a machine without a GPU.
#pragma once

#include <fsdp/device.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <memory>
#include <string>

namespace c10 {
struct StorageImpl;
}

namespace fsdp {
namespace device {

// A recorded point in one stream. Empty (the default, and every CPU event) means "already done".
class Event {
 public:
  Event() = default;
  explicit Event(std::shared_ptr<void> impl) : impl_(std::move(impl)) {}
  bool empty() const { return impl_ == nullptr; }
  void* impl() const { return impl_.get(); }

 private:
  std::shared_ptr<void> impl_;  // the implementation's own event type
};

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual c10::DeviceType type() const = 0;

  // The calling thread's current device of this type, and its change (CUDA's cudaSetDevice).
  virtual c10::Device current_device() = 0;
  virtual void set_current_device(c10::Device device) = 0;

  // The stream new work of the calling thread goes to on `device`.
  virtual c10::Stream current_stream(c10::Device device) = 0;
  // A stream beside the current one (a high-priority one for FSDP's communication, as FSDP2's
  // side streams are). On the CPU: the current stream.
  virtual c10::Stream side_stream(c10::Device device, bool high_priority) = 0;
  // Makes `stream` the calling thread's current stream on its device; returns the one before.
  virtual c10::Stream exchange_stream(c10::Stream stream) = 0;
  // The point `stream` has reached, as an event.
  virtual Event record(c10::Stream stream) = 0;
  // Work queued on `waiter` from now on starts after `event`. The host does not block.
  virtual void wait(c10::Stream waiter, const Event& event) = 0;
  // The host blocks until `event` has happened.
  virtual void synchronize(const Event& event) = 0;

  // Byte copies and zero fills on the current stream, between pointers of this device's memory
  // (or pinned host memory). Asynchronous with the host on an accelerator.
  virtual void copy_bytes(void* dst, const void* src, size_t nbytes) = 0;
  virtual void zero_bytes(void* dst, size_t nbytes) = 0;
  // Gives `storage` a new allocation of `nbytes` (0: frees it), keeping the StorageImpl, so that
  // every tensor on it (autograd's saved ones too) sees the new memory. Contents are undefined.
  virtual void resize_storage(c10::StorageImpl& storage, size_t nbytes) = 0;

  // Whether host memory can be pinned for this device's copies (CUDA: yes; the CPU: no, but in
  // its checking mode, which models pinned memory).
  virtual bool can_pin_host_memory() const = 0;
  // Whether work runs on streams, asynchronously to the host, so that FSDP makes its side streams
  // and orders them with events (CUDA, and the CPU's checking mode). The plain CPU: false.
  virtual bool has_streams() const = 0;
  // Whether host memory is this device's own memory, so that an offloaded tensor is used where it
  // is (the plain CPU); otherwise it is copied to the device first (CUDA, the CPU's checking mode).
  virtual bool shares_host_memory() const = 0;

  // Moving tensors between this device's memory and host memory (CPU offload). to_host: a copy of
  // `t`, cast to `dtype`, in host memory (pinned when `pinned`), on the current stream; with
  // `non_blocking` the host goes on before it lands, and must wait for an event recorded after it
  // before reading it. to_device: the reverse, into memory of `device`. On the plain CPU, where
  // host memory is the device's, both are a cast, and `t` itself when there is none.
  virtual at::Tensor to_host(const at::Tensor& t, at::ScalarType dtype, bool pinned, bool non_blocking) = 0;
  virtual at::Tensor to_device(const at::Tensor& t, c10::Device device, at::ScalarType dtype, bool non_blocking) = 0;
  // An uninitialised tensor shaped as `like`, in memory of `device`, allocated on the current stream.
  virtual at::Tensor empty_like_on(const at::Tensor& like, c10::Device device) = 0;

  // The devices of this type the process sees, and their allocators' statistics (fsdp/device.h).
  virtual int device_count() const = 0;
  virtual DeviceMemoryStats memory_stats(c10::Device device) = 0;
  virtual void reset_peak_memory(c10::Device device) = 0;
};

// The operations of `type`. Throws c10::Error naming the type and the build option when this
// build has no implementation for it.
DeviceOps& ops_for(c10::DeviceType type);
inline DeviceOps& ops_for(const c10::Device& device) { return ops_for(device.type()); }
bool has_ops_for(c10::DeviceType type);
// Called once by each implementation at library load (static initialisation).
void register_ops(std::unique_ptr<DeviceOps> ops);
// Why the CUDA path (libfsdp_cuda, beside libfsdp) could not be loaded, or loaded and registered
// nothing; "" once it is in use. Loads it if that has not happened yet, as ops_for(CUDA) and
// has_ops_for(CUDA) do.
std::string load_cuda_path_error();

// Makes a stream the current one for a scope, and restores the one before at its end, as
// c10::StreamGuard does, through the ops of the stream's device.
class StreamScope {
 public:
  explicit StreamScope(c10::Stream stream)
      : ops_(ops_for(stream.device_type())), previous_(ops_.exchange_stream(stream)) {}
  ~StreamScope() { ops_.exchange_stream(previous_); }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  DeviceOps& ops_;
  c10::Stream previous_;
};

}  // namespace device
}  // namespace fsdp
