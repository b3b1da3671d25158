# The CUDA path on a machine that has the CUDA build of PyTorch but no CUDA toolkit (no nvcc):
# -DFSDP_USE_CUDA=ON -DFSDP_CUDA_WITHOUT_NVCC=ON. Included before find_package(Torch).
#
# The torch wheel's CMake files (share/cmake/Caffe2/public/cuda.cmake) find CUDA through nvcc and
# call enable_language(CUDA), which fails without a CUDA compiler. fsdp-cpp compiles no CUDA code:
# its CUDA path needs the headers of the CUDA runtime and of the libraries ATen's CUDA headers
# include (cuBLAS, cuSPARSE, cuSOLVER), and libcudart. The wheel's nvidia-* packages beside torch/
# hold all of them: nvidia/cu13/{include,lib} for CUDA 13, a folder per library for CUDA 12.
# Two header folders of the toolkit are in no runtime wheel: crt/ (host_config.h, host_defines.h,
# which cuda_runtime.h includes; they ship with nvcc) and nv/ (nv/target, which cuda_fp16.h
# includes; CCCL's). They come from FSDP_CUDA_EXTRA_INCLUDE_DIR, a folder holding both from the
# same CUDA release (scripts/gpu-bundle.sh carries the local toolkit's), and only they go on the
# include path, through links.
# This file defines torch::cudart from them, so cuda.cmake's include guard skips the toolkit
# search, and sets CUDA::cudart, CUDAToolkit_INCLUDE_DIRS and CUDAToolkit_VERSION, which
# FsdpTorch.cmake then uses as find_package(CUDAToolkit) would have set them.
set(_fsdp_torch_prefix "")
foreach(_fsdp_prefix IN LISTS CMAKE_PREFIX_PATH)
  if(EXISTS "${_fsdp_prefix}/share/cmake/Torch/TorchConfig.cmake")
    set(_fsdp_torch_prefix "${_fsdp_prefix}")
    break()
  endif()
endforeach()
if(NOT _fsdp_torch_prefix AND Torch_DIR)
  get_filename_component(_fsdp_torch_prefix "${Torch_DIR}/../../.." ABSOLUTE)
endif()
if(NOT _fsdp_torch_prefix)
  message(FATAL_ERROR "fsdp: FSDP_CUDA_WITHOUT_NVCC=ON takes the CUDA headers from the nvidia-* wheels beside "
          "the torch package, but no entry of CMAKE_PREFIX_PATH (${CMAKE_PREFIX_PATH}) holds "
          "share/cmake/Torch: point it at the torch folder (torch.utils.cmake_prefix_path).")
endif()
get_filename_component(_fsdp_site_packages "${_fsdp_torch_prefix}/.." ABSOLUTE)
file(GLOB _fsdp_wheel_includes LIST_DIRECTORIES true "${_fsdp_site_packages}/nvidia/*/include")
file(GLOB _fsdp_wheel_libs LIST_DIRECTORIES true "${_fsdp_site_packages}/nvidia/*/lib")
find_path(FSDP_CUDA_RUNTIME_INCLUDE_DIR cuda_runtime_api.h HINTS ${_fsdp_wheel_includes} NO_DEFAULT_PATH)
find_library(FSDP_CUDART_LIBRARY NAMES cudart libcudart.so.13 libcudart.so.12 HINTS ${_fsdp_wheel_libs}
             NO_DEFAULT_PATH)
if(NOT FSDP_CUDA_RUNTIME_INCLUDE_DIR OR NOT FSDP_CUDART_LIBRARY)
  message(FATAL_ERROR "fsdp: FSDP_CUDA_WITHOUT_NVCC=ON found no CUDA runtime in the nvidia-* wheels under "
          "${_fsdp_site_packages}/nvidia (header cuda_runtime_api.h: '${FSDP_CUDA_RUNTIME_INCLUDE_DIR}', "
          "library libcudart: '${FSDP_CUDART_LIBRARY}'). Install the CUDA build of torch with its nvidia-* "
          "packages, or configure with the CUDA toolkit (nvcc) and FSDP_CUDA_WITHOUT_NVCC=OFF.")
endif()
set(FSDP_CUDA_EXTRA_INCLUDE_DIR "" CACHE PATH
    "FSDP_CUDA_WITHOUT_NVCC: a folder holding the toolkit's crt/ and nv/ of the wheel's CUDA release")
set(_fsdp_extra_link_dir "${CMAKE_BINARY_DIR}/fsdp-cuda-extra-include")
file(REMOVE_RECURSE "${_fsdp_extra_link_dir}")
file(MAKE_DIRECTORY "${_fsdp_extra_link_dir}")
foreach(_fsdp_header IN ITEMS crt/host_config.h nv/target)
  get_filename_component(_fsdp_folder "${_fsdp_header}" DIRECTORY)
  find_path(_fsdp_found "${_fsdp_header}" HINTS ${_fsdp_wheel_includes} NO_DEFAULT_PATH NO_CACHE)
  if(NOT _fsdp_found AND EXISTS "${FSDP_CUDA_EXTRA_INCLUDE_DIR}/${_fsdp_header}")
    file(CREATE_LINK "${FSDP_CUDA_EXTRA_INCLUDE_DIR}/${_fsdp_folder}" "${_fsdp_extra_link_dir}/${_fsdp_folder}" SYMBOLIC)
  elseif(NOT _fsdp_found)
    message(FATAL_ERROR "fsdp: FSDP_CUDA_WITHOUT_NVCC=ON needs CUDA's ${_fsdp_header}, which no nvidia-* wheel "
            "holds: set FSDP_CUDA_EXTRA_INCLUDE_DIR to a folder holding ${_fsdp_folder}/ of CUDA's include folder, of "
            "the wheel's CUDA release (scripts/gpu-bundle.sh carries the local toolkit's; now: "
            "'${FSDP_CUDA_EXTRA_INCLUDE_DIR}').")
  endif()
  unset(_fsdp_found)
endforeach()
file(STRINGS "${FSDP_CUDA_RUNTIME_INCLUDE_DIR}/cuda.h" _fsdp_cuda_version_line REGEX "^#define CUDA_VERSION [0-9]+")
string(REGEX REPLACE "^#define CUDA_VERSION ([0-9]+).*" "\\1" _fsdp_cuda_version_number "${_fsdp_cuda_version_line}")
math(EXPR _fsdp_cuda_major "${_fsdp_cuda_version_number} / 1000")
math(EXPR _fsdp_cuda_minor "(${_fsdp_cuda_version_number} % 1000) / 10")
set(CUDAToolkit_VERSION "${_fsdp_cuda_major}.${_fsdp_cuda_minor}")
set(CUDAToolkit_INCLUDE_DIRS ${_fsdp_wheel_includes} "${_fsdp_extra_link_dir}")
set(CUDAToolkit_FOUND TRUE)

add_library(CUDA::cudart SHARED IMPORTED GLOBAL)
set_target_properties(CUDA::cudart PROPERTIES
  IMPORTED_LOCATION "${FSDP_CUDART_LIBRARY}"
  INTERFACE_INCLUDE_DIRECTORIES "${FSDP_CUDA_RUNTIME_INCLUDE_DIR}")
add_library(torch::cudart INTERFACE IMPORTED GLOBAL)
set_target_properties(torch::cudart PROPERTIES INTERFACE_LINK_LIBRARIES CUDA::cudart)
message(STATUS "fsdp: no nvcc (FSDP_CUDA_WITHOUT_NVCC): CUDA ${CUDAToolkit_VERSION} headers and libcudart from "
        "${_fsdp_site_packages}/nvidia, crt/ and nv/ from ${FSDP_CUDA_EXTRA_INCLUDE_DIR}")
