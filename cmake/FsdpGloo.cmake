# Gloo, the transport under fsdp-cpp's collectives. Defines the INTERFACE target `fsdp_gloo`
# (gloo's headers, and gloo's library where it is a library of its own).
#
# Two layouts are known:
#  - a LibTorch that links a separate libgloo (Debian's libtorch-dev): the headers are in a
#    system include dir and libgloo.so is in that prefix's lib dir (or its multiarch subdir);
#  - a LibTorch from a PyTorch wheel: gloo's headers are in the LibTorch's include dir and
#    gloo's code is inside libtorch_cpu, so there is no library to find, and none is linked.
# The LibTorch's own include and library dirs are searched first, then CMake's default paths
# (which add the multiarch subdirs through CMAKE_LIBRARY_ARCHITECTURE themselves).
find_path(FSDP_GLOO_INCLUDE_DIR gloo/context.h HINTS ${TORCH_INCLUDE_DIRS})
if(NOT FSDP_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "gloo headers not found: install libgloo-dev (Debian) or use a LibTorch that ships include/gloo")
endif()

# Where this LibTorch keeps its libraries, and the lib dir next to the gloo headers.
set(_fsdp_gloo_hints)
if(TORCH_LIBRARY)
  get_filename_component(_fsdp_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
  list(APPEND _fsdp_gloo_hints "${_fsdp_torch_lib_dir}")
endif()
get_filename_component(_fsdp_gloo_prefix "${FSDP_GLOO_INCLUDE_DIR}" DIRECTORY)
list(APPEND _fsdp_gloo_hints "${_fsdp_gloo_prefix}/lib")
find_library(FSDP_GLOO_LIBRARY NAMES gloo HINTS ${_fsdp_gloo_hints} NO_DEFAULT_PATH)

# Headers that are this LibTorch's own, with no libgloo beside them, are the wheel layout:
# looking further could pick up an unrelated system libgloo next to the gloo inside libtorch_cpu.
set(_fsdp_gloo_in_torch FALSE)
if(TORCH_INSTALL_PREFIX)
  get_filename_component(_fsdp_torch_include "${TORCH_INSTALL_PREFIX}/include" REALPATH)
  get_filename_component(_fsdp_gloo_include "${FSDP_GLOO_INCLUDE_DIR}" REALPATH)
  if(_fsdp_gloo_include STREQUAL _fsdp_torch_include)
    set(_fsdp_gloo_in_torch TRUE)
  endif()
endif()
if(NOT FSDP_GLOO_LIBRARY AND NOT _fsdp_gloo_in_torch)
  find_library(FSDP_GLOO_LIBRARY NAMES gloo)
endif()

add_library(fsdp_gloo INTERFACE)
target_include_directories(fsdp_gloo INTERFACE ${FSDP_GLOO_INCLUDE_DIR})
if(FSDP_GLOO_LIBRARY)
  target_link_libraries(fsdp_gloo INTERFACE ${FSDP_GLOO_LIBRARY})
  message(STATUS "fsdp: gloo headers in ${FSDP_GLOO_INCLUDE_DIR}, library ${FSDP_GLOO_LIBRARY}")
else()
  message(STATUS "fsdp: gloo headers in ${FSDP_GLOO_INCLUDE_DIR}; no separate libgloo (its code is in libtorch_cpu)")
endif()
unset(_fsdp_gloo_hints)
unset(_fsdp_gloo_prefix)
unset(_fsdp_gloo_in_torch)
unset(_fsdp_torch_lib_dir)
unset(_fsdp_torch_include)
unset(_fsdp_gloo_include)
