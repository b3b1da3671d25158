# LibTorch as fsdp-cpp links it: the imported target fsdp_torch. Needs find_package(Torch) first.
#
# Every source file compiles against LibTorch's CPU headers and libraries only (fsdp_torch), in
# both configurations, so that a CPU build never loads the CUDA libraries (hundreds of MiB more
# resident memory and a slower start for every process) and every object file but the CUDA
# path's is the same in both configurations.
#
# With FSDP_USE_CUDA=ON, the CUDA path's few source files (fsdp_add_cuda_part) also see the CUDA
# toolkit's and NCCL's headers and c10d's NCCL declarations, and make a library of their own,
# libfsdp_cuda, which links the whole of LibTorch (fsdp_torch_cuda: libtorch_cuda, c10_cuda, the
# CUDA runtime) and which libfsdp loads when it is itself loaded. Installed beside
# fsdpConfig.cmake, which includes it the same way for find_package(fsdp).

# libtorch_cuda of the wheel finds the wheel's NCCL, cuDNN, ... (nvidia/*/lib beside torch/)
# through its $ORIGIN rpath when it loads; the linker of an executable does not follow that, so
# `target`, which links libtorch_cuda, tells it where they are: fsdp_torch_cuda here, LibTorch's
# torch_cuda_library for a consumer's ${TORCH_LIBRARIES} (fsdpConfig.cmake). Does nothing for a
# LibTorch without CUDA or without the nvidia-* wheels beside it.
function(fsdp_torch_cuda_link_paths target)
  if(NOT TARGET torch_cuda)
    return()
  endif()
  get_filename_component(_site_packages "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
  file(GLOB _nvidia_lib_dirs LIST_DIRECTORIES true "${_site_packages}/nvidia/*/lib")
  if(_nvidia_lib_dirs)
    string(REPLACE ";" ":" _rpath_link "${_nvidia_lib_dirs}")
    set_property(TARGET ${target} APPEND PROPERTY INTERFACE_LINK_OPTIONS "LINKER:-rpath-link,${_rpath_link}")
  endif()
endfunction()

if(NOT TARGET fsdp_torch)
  add_library(fsdp_torch INTERFACE IMPORTED GLOBAL)
  set_target_properties(fsdp_torch PROPERTIES
    INTERFACE_LINK_LIBRARIES "torch_cpu_library;c10"
    INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}")
  if(FSDP_USE_CUDA)
    if(NOT TARGET torch_cuda)
      message(FATAL_ERROR "fsdp: FSDP_USE_CUDA=ON needs a LibTorch built with CUDA, but the one found "
              "(${Torch_DIR}) has no torch_cuda target. Install the CUDA build of PyTorch (scripts/install-deps.sh "
              "does), or configure with -DFSDP_USE_CUDA=OFF.")
    endif()
    if(NOT FSDP_CUDA_WITHOUT_NVCC)
      find_package(CUDAToolkit REQUIRED)  # else FsdpCudaWithoutNvcc.cmake set what it sets
    endif()
    # NCCL's header: from the PyTorch wheel's nvidia-nccl package beside torch/, else the system's.
    get_filename_component(_fsdp_site_packages "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
    find_path(FSDP_NCCL_INCLUDE_DIR nccl.h
              HINTS "${_fsdp_site_packages}/nvidia/nccl/include" ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
    if(NOT FSDP_NCCL_INCLUDE_DIR)
      message(FATAL_ERROR "fsdp: FSDP_USE_CUDA=ON needs NCCL's nccl.h (the nvidia-nccl wheel beside torch/, or "
              "Debian's libnccl-dev); none found. Set FSDP_NCCL_INCLUDE_DIR to its folder.")
    endif()
    set(FSDP_CUDA_INCLUDE_DIRS ${CUDAToolkit_INCLUDE_DIRS} "${FSDP_NCCL_INCLUDE_DIR}")
    add_library(fsdp_torch_cuda INTERFACE IMPORTED GLOBAL)
    set_target_properties(fsdp_torch_cuda PROPERTIES INTERFACE_LINK_LIBRARIES "torch;CUDA::cudart")
    fsdp_torch_cuda_link_paths(fsdp_torch_cuda)
    message(STATUS "fsdp: the CUDA path is built (CUDA ${CUDAToolkit_VERSION}, nccl.h in ${FSDP_NCCL_INCLUDE_DIR})")
  endif()
endif()

# The part of the CUDA path that belongs to `layer`: an object library fsdp_<layer>_cuda, compiled
# as the layer's own code (its include view) that also sees CUDA's and NCCL's headers and c10d's
# NCCL declarations (USE_C10D_NCCL). src/CMakeLists.txt links the parts into libfsdp_cuda.
# Only for FSDP_USE_CUDA=ON.
function(fsdp_add_cuda_part layer)
  add_library(fsdp_${layer}_cuda OBJECT ${ARGN})
  set_target_properties(fsdp_${layer}_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_include_directories(fsdp_${layer}_cuda PRIVATE "${FSDP_LAYER_VIEWS_DIR}/${layer}" ${FSDP_CUDA_INCLUDE_DIRS})
  target_compile_definitions(fsdp_${layer}_cuda PRIVATE USE_C10D_NCCL)
  target_link_libraries(fsdp_${layer}_cuda PRIVATE fsdp_layer_flags)
  set_property(GLOBAL APPEND PROPERTY FSDP_CUDA_PARTS fsdp_${layer}_cuda)
endfunction()
