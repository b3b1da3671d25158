# The installed fsdp-cpp as packages: fsdp.pc for pkg-config, and the Debian package that
# `cpack -G DEB` makes from a built folder (the library, its headers, the CMake and pkg-config
# files, fsdprun and fsdp-train, the example configurations). Included by CMakeLists.txt after
# the install rules.
#
# LibTorch is not in the package: the library and the programs find the one they were built
# against at its path (the install run path, CMakeLists.txt), so the package works on machines
# that have that LibTorch at the same path (the PyTorch wheel of scripts/install-deps.sh).

# ---------------------------------------------------------------- pkg-config
set(FSDP_PC_TORCH_INCLUDEDIR "${TORCH_INSTALL_PREFIX}/include")
set(FSDP_PC_TORCH_LIBDIR "${TORCH_INSTALL_PREFIX}/lib")
# LibTorch's own definitions (c10d's backends), which its headers are compiled with.
get_target_property(_fsdp_torch_defines torch_cpu INTERFACE_COMPILE_DEFINITIONS)
set(FSDP_PC_TORCH_DEFINES "")
foreach(_define IN LISTS _fsdp_torch_defines)
  if(_define AND NOT _define MATCHES "\\$<")
    string(APPEND FSDP_PC_TORCH_DEFINES " -D${_define}")
  endif()
endforeach()
string(STRIP "${FSDP_PC_TORCH_DEFINES} ${TORCH_CXX_FLAGS}" FSDP_PC_TORCH_DEFINES)
configure_file(${CMAKE_CURRENT_LIST_DIR}/fsdp.pc.in ${PROJECT_BINARY_DIR}/fsdp.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/fsdp.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# ---------------------------------------------------------------- Debian package
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME fsdp-cpp)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "fsdp-cpp")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "PyTorch FSDP2 (fully_shard) for LibTorch C++ programs")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # fsdp-cpp_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "fsdp-cpp maintainers")
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
set(CPACK_PACKAGE_DESCRIPTION
    "libfsdp, its headers, CMake (find_package(fsdp)) and pkg-config (fsdp) files, the launcher fsdprun and the trainer fsdp-train. Built against LibTorch ${Torch_VERSION} at ${TORCH_INSTALL_PREFIX}, which it needs at that path.")
# The Debian libraries it links (yaml-cpp, zlib, MPI, ...) from dpkg-shlibdeps; LibTorch's,
# which no Debian package holds, are found in its folder and ask for nothing, and so is
# libfsdp_cuda's CUDA runtime (the toolkit's or the wheel's).
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${TORCH_INSTALL_PREFIX}/lib")
if(TARGET fsdp_cuda)
  get_target_property(_fsdp_cudart CUDA::cudart IMPORTED_LOCATION)
  if(_fsdp_cudart)
    get_filename_component(_fsdp_cudart_dir "${_fsdp_cudart}" DIRECTORY)
    list(APPEND CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${_fsdp_cudart_dir}")
  endif()
endif()
include(CPack)
