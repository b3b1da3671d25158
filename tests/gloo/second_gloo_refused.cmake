# A configuration that would link a second gloo beside the one inside libtorch_cpu must fail at
# configure time, naming the gloo. Configures the project itself into WORK_DIR, once with each
# way a library reaches the link line: the global linker flags, and a target's link libraries
# (through a project of one file that adds this source tree and links gloo to a target of its own).
#   cmake -DSOURCE_DIR=... -DWORK_DIR=... -DTORCH_DIR=<LibTorch's share/cmake/Torch> -P second_gloo_refused.cmake
set(common_args -G Ninja "-DTorch_DIR=${TORCH_DIR}" -DFSDP_BUILD_TESTS=OFF
    -DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_BUILD_TOOLS=OFF)

function(expect_refused label)
  file(REMOVE_RECURSE "${WORK_DIR}/${label}")
  execute_process(COMMAND ${CMAKE_COMMAND} ${ARGN} -B "${WORK_DIR}/${label}" ${common_args}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${label}: configuring with a second gloo succeeded; it must be refused.\n${out}\n${err}")
  endif()
  if(NOT err MATCHES "links a separate gloo")
    message(FATAL_ERROR "${label}: configure failed, but not with the second-gloo message:\n${err}")
  endif()
  message(STATUS "${label}: refused as expected")
endfunction()

expect_refused(linker_flags -S "${SOURCE_DIR}" "-DCMAKE_SHARED_LINKER_FLAGS=-lgloo")

# A consumer project that builds fsdp-cpp as a subdirectory and links a libgloo into a target.
file(MAKE_DIRECTORY "${WORK_DIR}/consumer_src")
file(WRITE "${WORK_DIR}/consumer_src/CMakeLists.txt" "
cmake_minimum_required(VERSION 3.18)
project(consumer CXX)
add_subdirectory(\"${SOURCE_DIR}\" fsdp)
add_executable(uses_gloo \"${SOURCE_DIR}/tests/gloo/empty_main.cpp\")
target_link_libraries(uses_gloo PRIVATE fsdp::fsdp /usr/lib/libgloo.so)
fsdp_refuse_second_gloo(uses_gloo)
")
expect_refused(target_link -S "${WORK_DIR}/consumer_src")
