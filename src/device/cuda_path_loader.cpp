// Loads the CUDA path (libfsdp_cuda, which links libtorch_cuda) when libfsdp itself is loaded, if
// this build put one beside it.
//
// ATen decides once per process whether it has CUDA, at the first question it is asked
// (getCUDAHooks() keeps its answer), and torch::manual_seed, at::hasCUDA and pin_memory all ask.
// Loaded at fsdp-cpp's first CUDA query instead, the CUDA path would come too late for a program
// whose first line is torch::manual_seed(0): no pinned memory, unseeded CUDA generators and an
// autograd engine without device threads, for the life of the process.
//
// The price: every process of a CUDA build loads libtorch_cuda at start, whether it uses a GPU or
// not (a slower start and hundreds of MiB more resident memory). FSDP_CUDA_PATH=lazy defers
// the loading to the first CUDA query, for a program of a CUDA build that runs on the CPU only;
// one that then asks ATen first is refused with the reason (cuda_device_ops.cpp). A CPU build has
// no libfsdp_cuda and pays one failed file lookup.
#include "src/device/device_ops.h"

#include <cstdlib>
#include <cstring>

namespace fsdp {
namespace device {
namespace {

bool deferred_by_environment() {
  const char* v = std::getenv("FSDP_CUDA_PATH");
  return v != nullptr && std::strcmp(v, "lazy") == 0;
}

const bool cuda_path_loaded_with_libfsdp = [] {
  if (!deferred_by_environment()) load_cuda_path_error();  // why it could not be is asked where it matters
  return true;
}();

}  // namespace
}  // namespace device
}  // namespace fsdp
