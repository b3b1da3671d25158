# Gloo, the transport under fsdp-cpp's CPU collectives: the one copy inside LibTorch 2.x's
# libtorch_cpu, reached through c10d's ProcessGroupGloo. A second gloo in the process (a separate
# libgloo, e.g. Debian's libgloo-dev, linked beside libtorch_cpu) gives two definitions of every
# gloo symbol and corrupts memory silently, so this build refuses any configuration that would
# link one, and a LibTorch that itself links a separate libgloo (Debian's LibTorch 1.13).
#
# Defines fsdp_gloo_names_dir (the include path for the two files that include c10d's
# ProcessGroupGloo.hpp; see src/comm/gloo_names/README.md) and fsdp_refuse_second_gloo(<target>...),
# called on every target the project links once they are all defined.

set(fsdp_gloo_names_dir "${PROJECT_SOURCE_DIR}/src/comm/gloo_names")

# The LibTorch's own libraries must not load a libgloo of their own.
function(_fsdp_check_torch_has_gloo_inside)
  get_target_property(_torch_cpu_location torch_cpu IMPORTED_LOCATION)
  if(NOT _torch_cpu_location)
    get_target_property(_torch_cpu_location torch_cpu IMPORTED_LOCATION_RELEASE)
  endif()
  if(NOT _torch_cpu_location OR NOT EXISTS "${_torch_cpu_location}")
    return()
  endif()
  if(NOT CMAKE_OBJDUMP)
    return()
  endif()
  execute_process(COMMAND "${CMAKE_OBJDUMP}" -p "${_torch_cpu_location}"
                  OUTPUT_VARIABLE _dynamic ERROR_QUIET RESULT_VARIABLE _rc)
  string(REGEX MATCH "NEEDED +libgloo[^\n]*" _gloo_needed "${_dynamic}")
  if(_rc EQUAL 0 AND _gloo_needed)
    message(FATAL_ERROR "fsdp: this LibTorch (${_torch_cpu_location}) links a separate gloo "
            "(${_gloo_needed}); fsdp-cpp needs a LibTorch 2.x with gloo inside libtorch_cpu "
            "(the PyTorch wheel or the LibTorch archive; scripts/install-deps.sh installs one).")
  endif()
endfunction()
_fsdp_check_torch_has_gloo_inside()

# Any mention of a gloo library on a target's link line or in the global linker flags.
function(fsdp_refuse_second_gloo)
  foreach(_flags_var CMAKE_EXE_LINKER_FLAGS CMAKE_SHARED_LINKER_FLAGS CMAKE_MODULE_LINKER_FLAGS)
    if("${${_flags_var}}" MATCHES "(^|[ /:])(lib)?gloo([.][a-z0-9.]*)?( |$)|-lgloo")
      message(FATAL_ERROR "fsdp: ${_flags_var} links a separate gloo ('${${_flags_var}}'). LibTorch "
              "already carries gloo inside libtorch_cpu, and a second copy in the process corrupts "
              "memory silently: remove it.")
    endif()
  endforeach()
  foreach(_target IN LISTS ARGN)
    if(NOT TARGET ${_target})
      continue()
    endif()
    foreach(_prop LINK_LIBRARIES INTERFACE_LINK_LIBRARIES)
      get_target_property(_libs ${_target} ${_prop})
      if(NOT _libs)
        continue()
      endif()
      foreach(_lib IN LISTS _libs)
        if(_lib MATCHES "(^|/)(lib)?gloo([.][a-z0-9.]*)?$|^-lgloo$|^Gloo::")
          message(FATAL_ERROR "fsdp: target ${_target} links a separate gloo ('${_lib}'). LibTorch "
                  "already carries gloo inside libtorch_cpu, and a second copy in the process "
                  "corrupts memory silently: remove it.")
        endif()
      endforeach()
    endforeach()
  endforeach()
endfunction()
