# The Debian package of the build at FSDP_BINARY_DIR, made with `cpack -G DEB` and unpacked with
# `dpkg -x` into a scratch root, used the way docs/own-program.md says:
#   - the package holds the library (with its SONAME), headers, CMake and pkg-config files, tools;
#   - the consumer project (this folder) builds against it with find_package(fsdp <version>
#     REQUIRED), and runs alone and as two ranks under the installed fsdprun; the next minor
#     version is refused (SameMinorVersion);
#   - the consumer's main.cpp builds against it with pkg-config alone, and runs;
#   - the installed fsdprun runs the installed fsdp-train with no environment at all.
# Run by ctest (tests/CMakeLists.txt) with FSDP_BINARY_DIR, CONSUMER_SOURCE_DIR, VERSION, WORK_DIR
# and CPACK (the cpack of the CMake that configured the build).
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()
function(expect_in text what)
  string(FIND "${text}" "${what}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "expected '${what}' in:\n${text}")
  endif()
endfunction()
string(REGEX MATCH "^[0-9]+\\.[0-9]+" major_minor "${VERSION}")

# The package, from the built folder as it is (cpack installs it; nothing is compiled).
run("${CPACK}" -G DEB --config "${FSDP_BINARY_DIR}/CPackConfig.cmake" -B "${WORK_DIR}/cpack")
file(GLOB deb "${WORK_DIR}/cpack/fsdp-cpp_${VERSION}_*.deb")
if(NOT deb)
  message(FATAL_ERROR "cpack made no fsdp-cpp_${VERSION}_*.deb in ${WORK_DIR}/cpack")
endif()
run(dpkg-deb --field "${deb}" Package Version Depends)
message(STATUS "${run_output}")
run(dpkg-deb --contents "${deb}")
foreach(file ./usr/lib/libfsdp.so.${VERSION} ./usr/lib/libfsdp.so.${major_minor} ./usr/include/fsdp/fully_shard.h
        ./usr/lib/cmake/fsdp/fsdpConfigVersion.cmake ./usr/lib/pkgconfig/fsdp.pc ./usr/bin/fsdprun ./usr/bin/fsdp-train
        ./usr/share/fsdp-cpp/configs/tiny.yaml)
  expect_in("${run_output}" "${file}")
endforeach()
set(root "${WORK_DIR}/root")
run(dpkg -x "${deb}" "${root}")
run(readelf -d "${root}/usr/lib/libfsdp.so.${VERSION}")
expect_in("${run_output}" "Library soname: [libfsdp.so.${major_minor}]")

# find_package(fsdp <version> REQUIRED): the consumer project, configured, built and run with
# nothing but the package's prefix (LibTorch is found where fsdp-cpp was built against it).
run(${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release
    "-DCMAKE_PREFIX_PATH=${root}/usr")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/cmake")
run(env -i "${WORK_DIR}/cmake/consumer")
expect_in("${run_output}" "full_tensor matches")
run(env -i "${root}/usr/bin/fsdprun" --standalone --nproc-per-node 2 "${WORK_DIR}/cmake/consumer")
expect_in("${run_output}" "consumer rank 1: DeviceMesh('cpu', shape=[2]")
string(REGEX MATCHALL "full_tensor matches" matches "${run_output}")
list(LENGTH matches matched)
if(NOT matched EQUAL 2)
  message(FATAL_ERROR "expected both ranks to say 'full_tensor matches':\n${run_output}")
endif()
# The next minor version is another interface: refused, before any of the package is loaded.
string(REGEX REPLACE "^([0-9]+)\\.([0-9]+)$" "\\1;\\2" parts "${major_minor}")
list(GET parts 0 major)
list(GET parts 1 minor)
math(EXPR next_minor "${minor} + 1")
file(WRITE "${WORK_DIR}/next/CMakeLists.txt"
     "cmake_minimum_required(VERSION 3.18)\nproject(next NONE)\nfind_package(fsdp ${major}.${next_minor} QUIET)\n"
     "if(fsdp_FOUND)\n  message(FATAL_ERROR \"find_package(fsdp ${major}.${next_minor}) accepted \${fsdp_VERSION}\")\nendif()\n"
     "if(NOT \"${VERSION}\" IN_LIST fsdp_CONSIDERED_VERSIONS)\n"
     "  message(FATAL_ERROR \"the package's fsdp ${VERSION} was not even considered: \${fsdp_CONSIDERED_CONFIGS}\")\nendif()\n")
run(${CMAKE_COMMAND} -S "${WORK_DIR}/next" -B "${WORK_DIR}/next/build" "-DCMAKE_PREFIX_PATH=${root}/usr")

# pkg-config alone: the same main.cpp, compiled and linked with what fsdp.pc says.
set(ENV{PKG_CONFIG_PATH} "${root}/usr/lib/pkgconfig")
run(pkg-config --modversion fsdp)
expect_in("${run_output}" "${VERSION}")
run(pkg-config --exists "fsdp >= ${major_minor}")
run(pkg-config --cflags fsdp)
separate_arguments(cflags UNIX_COMMAND "${run_output}")
run(pkg-config --libs fsdp)
separate_arguments(libs UNIX_COMMAND "${run_output}")
run(pkg-config --variable=libdir fsdp)
string(STRIP "${run_output}" libdir)
run(c++ ${cflags} "${CONSUMER_SOURCE_DIR}/main.cpp" -o "${WORK_DIR}/consumer-pc" ${libs} "-Wl,-rpath,${libdir}")
run(env -i "${WORK_DIR}/consumer-pc")
expect_in("${run_output}" "full_tensor matches")

# The installed launcher runs the installed trainer, two ranks, with no environment at all: both
# find libfsdp and LibTorch through their run paths.
run(env -i "${root}/usr/bin/fsdprun" --standalone --nproc-per-node 2 "${root}/usr/bin/fsdp-train"
    "${root}/usr/share/fsdp-cpp/configs/tiny.yaml" --training.steps=2 --training.keep_checkpoints=0
    --fsdp_config.checkpoint_interval=0 "--fsdp_config.checkpoint_dir=${WORK_DIR}/ckpt" --logging.progress=off
    --training.export=none --sample.length=0)
expect_in("${run_output}" "collectives on gloo")
message(STATUS "the package installs, and the consumer builds and runs against it with find_package(fsdp ${major_minor}) and pkg-config")
