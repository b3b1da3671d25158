# Gloo, the transport under fsdp-cpp's collectives.
# Debian's LibTorch links the system libgloo (headers in /usr/include/gloo); a LibTorch
# from a PyTorch wheel ships gloo's headers in its include dir and gloo's code inside
# libtorch_cpu. Either way this defines an INTERFACE target `fsdp_gloo`.
find_path(FSDP_GLOO_INCLUDE_DIR gloo/context.h HINTS ${TORCH_INCLUDE_DIRS})
if(NOT FSDP_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "gloo headers not found: install libgloo-dev (Debian) or use a LibTorch that ships include/gloo")
endif()
find_library(FSDP_GLOO_LIBRARY NAMES gloo PATHS /usr/lib /usr/lib/x86_64-linux-gnu NO_DEFAULT_PATH)
add_library(fsdp_gloo INTERFACE)
target_include_directories(fsdp_gloo INTERFACE ${FSDP_GLOO_INCLUDE_DIR})
if(FSDP_GLOO_LIBRARY)
  target_link_libraries(fsdp_gloo INTERFACE ${FSDP_GLOO_LIBRARY})
endif()
