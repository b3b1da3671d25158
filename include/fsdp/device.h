// layer: device (what may include what: docs/architecture.md)
/// \file
/// fsdp/device.h — which accelerators this build and this machine offer, and the memory of a
/// CUDA device as its caching allocator counts it (torch.cuda.memory_allocated() and friends).
///
/// \code{.cpp}
///   if (fsdp::cuda_available()) {
///     fsdp::reset_peak_device_memory(c10::Device("cuda:0"));
///     train_step();
///     auto m = fsdp::device_memory_stats(c10::Device("cuda:0"));  // m.max_allocated_bytes ...
///   }
/// \endcode
///
/// None of these communicate. CPU memory has its own accounting: fsdp/memory.h.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace fsdp {

/// True when this build has the CUDA path (-DFSDP_USE_CUDA=ON), whatever the machine. False, with
/// the reason in cuda_unavailable_reason(), also when the CUDA path came after ATen had decided
/// that this process has no CUDA (FSDP_CUDA_PATH=lazy, then torch::manual_seed before any CUDA
/// query of fsdp-cpp).
bool built_with_cuda();
/// True when this build has the CUDA path and the process sees at least one CUDA device.
/// Never throws.
bool cuda_available();
/// Why cuda_available() is false, in one sentence ("" when it is true): for skipped tests and for
/// the errors of configurations that ask for a GPU.
std::string cuda_unavailable_reason();
/// The number of CUDA devices this process sees (0 without the CUDA path).
int cuda_device_count();

/// What a device's caching allocator holds, in bytes: `allocated` is live tensor storage,
/// `reserved` what the allocator keeps from the driver (allocated + cached). Peaks since the last
/// reset_peak_device_memory().
struct DeviceMemoryStats {
  int64_t allocated_bytes = 0;      ///< live tensor storage now
  int64_t max_allocated_bytes = 0;  ///< its peak
  int64_t reserved_bytes = 0;       ///< held from the driver now (allocated + cached)
  int64_t max_reserved_bytes = 0;   ///< its peak
};
/// The statistics of `device`. A CPU device has none: all zeros (fsdp/memory.h counts host
/// memory). Throws c10::Error for a CUDA device in a build without the CUDA path.
DeviceMemoryStats device_memory_stats(c10::Device device);
/// Sets the peaks of `device` to the current values. Does nothing for a CPU device.
void reset_peak_device_memory(c10::Device device);

}  // namespace fsdp
