# LibTorch as fsdp-cpp links it: the imported target fsdp_torch. Needs find_package(Torch) first.
#
# With the CUDA parts off (FSDP_USE_CUDA=OFF), only LibTorch's CPU libraries: the PyTorch wheel's
# `torch` target also links libtorch_cuda, which loads the CUDA libraries into every process
# (hundreds of MiB more resident memory and a slower start for every process) for nothing a
# CPU mesh uses. With them on, the whole of LibTorch.
# Installed beside fsdpConfig.cmake, which includes it the same way for find_package(fsdp).
if(NOT TARGET fsdp_torch)
  add_library(fsdp_torch INTERFACE IMPORTED GLOBAL)
  if(FSDP_USE_CUDA)
    set_target_properties(fsdp_torch PROPERTIES INTERFACE_LINK_LIBRARIES torch)
  else()
    set_target_properties(fsdp_torch PROPERTIES
      INTERFACE_LINK_LIBRARIES "torch_cpu_library;c10"
      INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}")
  endif()
endif()
