# FsdpLayers.cmake — the layers of src/, enforced by the compiler.
#
# Each folder of src/ is one layer, compiled as an object library fsdp_<layer> that sees only
# the headers of its own layer and of the layers it may use. It does not get the repository
# root or include/ on its include path; it gets a view, build/layers/<layer>/, made at configure
# time, which holds symbolic links to:
#   src/<folder>    for its own folder, and for each folder it may use that shares its
#                   private headers (SHARED_PRIVATE_HEADERS: the infrastructure below the
#                   APIs); included as "src/<folder>/x.h". The private headers of fsdp, ddp,
#                   tp and the layers above them are seen by their own folder only;
#   fsdp/<header>   for each public header whose first line names such a layer
#                   ("// layer: <name> ..."), included as <fsdp/x.h>.
# A wrong-way include (a private header of a folder it may not use, or a public header of a
# layer above or beside it) then fails to compile with "No such file or directory". The public
# headers' own includes obey the same rule, since they are read through the same view.
#
# fsdp_define_layer(<layer> [SHARED_PRIVATE_HEADERS] USES <layer>...) lists what a layer may
# include, in full (no transitive closure: the list is the rule, readable in one place).

# A cache entry, so that tests/layers (another directory scope) sees it too.
set(FSDP_LAYER_VIEWS_DIR "${PROJECT_BINARY_DIR}/layers" CACHE INTERNAL "the layers' include views")

# The flags every layer compiles with, identical so that one precompiled header serves all.
add_library(fsdp_layer_flags INTERFACE)
target_link_libraries(fsdp_layer_flags INTERFACE fsdp_torch Threads::Threads nlohmann_json::nlohmann_json ZLIB::ZLIB)
target_compile_features(fsdp_layer_flags INTERFACE cxx_std_20)

# The layer each public header declares on its first line.
function(_fsdp_public_header_layers out_headers)
  file(GLOB_RECURSE _headers CONFIGURE_DEPENDS RELATIVE "${PROJECT_SOURCE_DIR}/include/fsdp"
       "${PROJECT_SOURCE_DIR}/include/fsdp/*.h")
  foreach(_h IN LISTS _headers)
    set(_path "${PROJECT_SOURCE_DIR}/include/fsdp/${_h}")
    # Configure again when a header's first line (its layer) may have changed.
    set_property(DIRECTORY "${PROJECT_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_path}")
    file(STRINGS "${_path}" _first LIMIT_COUNT 1)
    if(NOT _first MATCHES "^// layer: ([a-z]+) ")
      message(FATAL_ERROR "fsdp: include/fsdp/${_h} does not state its layer on its first line; start it with "
              "'// layer: <name> (what may include what: docs/architecture.md)', <name> one of: ${FSDP_LAYERS}")
    endif()
    set(_layer "${CMAKE_MATCH_1}")
    if(NOT _layer IN_LIST FSDP_LAYERS)
      message(FATAL_ERROR "fsdp: include/fsdp/${_h} names layer '${_layer}', which does not exist; one of: "
              "${FSDP_LAYERS}")
    endif()
    set_property(GLOBAL APPEND PROPERTY FSDP_HEADERS_OF_${_layer} "${_h}")
  endforeach()
  set(${out_headers} ${_headers} PARENT_SCOPE)
endfunction()

# build/layers/<view>/ for code of <layer> that may use <uses>.
function(_fsdp_make_view view layer)
  set(_dir "${FSDP_LAYER_VIEWS_DIR}/${view}")
  file(REMOVE_RECURSE "${_dir}")
  file(MAKE_DIRECTORY "${_dir}/src" "${_dir}/fsdp")
  foreach(_l IN ITEMS ${layer} ${ARGN})
    get_property(_shared GLOBAL PROPERTY FSDP_LAYER_SHARES_PRIVATE_${_l})
    if(EXISTS "${PROJECT_SOURCE_DIR}/src/${_l}" AND (_l STREQUAL layer OR _shared))
      file(CREATE_LINK "${PROJECT_SOURCE_DIR}/src/${_l}" "${_dir}/src/${_l}" SYMBOLIC)
    endif()
    get_property(_headers GLOBAL PROPERTY FSDP_HEADERS_OF_${_l})
    foreach(_h IN LISTS _headers)
      get_filename_component(_sub "${_h}" DIRECTORY)
      if(_sub)
        file(MAKE_DIRECTORY "${_dir}/fsdp/${_sub}")
      endif()
      file(CREATE_LINK "${PROJECT_SOURCE_DIR}/include/fsdp/${_h}" "${_dir}/fsdp/${_h}" SYMBOLIC)
    endforeach()
  endforeach()
endfunction()

# Declares a layer: its object library fsdp_<layer> and its view. Call in layer order, after
# FSDP_LAYERS is set and _fsdp_public_header_layers has run.
function(fsdp_define_layer layer)
  cmake_parse_arguments(PARSE_ARGV 1 _arg "SHARED_PRIVATE_HEADERS" "" "USES")
  set_property(GLOBAL PROPERTY FSDP_LAYER_SHARES_PRIVATE_${layer} ${_arg_SHARED_PRIVATE_HEADERS})
  foreach(_u IN LISTS _arg_USES)
    if(NOT TARGET fsdp_${_u})
      message(FATAL_ERROR "fsdp: layer '${layer}' uses '${_u}', which is not defined before it")
    endif()
  endforeach()
  set_property(GLOBAL PROPERTY FSDP_LAYER_USES_${layer} ${_arg_USES})
  _fsdp_make_view(${layer} ${layer} ${_arg_USES})
  add_library(fsdp_${layer} OBJECT)
  set_target_properties(fsdp_${layer} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_include_directories(fsdp_${layer} PRIVATE "${FSDP_LAYER_VIEWS_DIR}/${layer}")
  target_link_libraries(fsdp_${layer} PRIVATE fsdp_layer_flags)
endfunction()

# An object library compiled exactly as code of <layer> is, from <source>: for the tests that
# show a wrong-way include fails (tests/layers). Not built by default.
function(fsdp_add_layer_probe target layer source)
  add_library(${target} OBJECT EXCLUDE_FROM_ALL "${source}")
  target_include_directories(${target} PRIVATE "${FSDP_LAYER_VIEWS_DIR}/${layer}")
  target_link_libraries(${target} PRIVATE fsdp_layer_flags)
endfunction()
