# docs/own-program.md shows tests/consumer's CMakeLists.txt and main.cpp: each must appear there
# whole, as a fenced block, so that the page is what the package test builds.
# Run by ctest with DOC and CONSUMER_SOURCE_DIR.
file(READ "${DOC}" doc)
foreach(pair "cmake;CMakeLists.txt" "cpp;main.cpp")
  list(GET pair 0 fence)
  list(GET pair 1 name)
  file(READ "${CONSUMER_SOURCE_DIR}/${name}" content)
  string(FIND "${doc}" "```${fence}\n${content}```\n" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${DOC} does not show tests/consumer/${name} as it is: copy the file into its "
            "```${fence} block there (or change the file to what the page says).")
  endif()
endforeach()
