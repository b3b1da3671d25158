# Installs the build at FSDP_BINARY_DIR into a scratch prefix, then configures, builds and runs
# a consumer project (CONSUMER_SOURCE_DIR) against it with find_package(fsdp), with no
# environment (the consumer finds libfsdp and LibTorch through its run path).
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${FSDP_BINARY_DIR}" --prefix "${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build"
    -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix "-DTorch_DIR=${TORCH_DIR}"
    -DCMAKE_BUILD_TYPE=Release -G Ninja)
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run(env -i "${WORK_DIR}/build/consumer")
