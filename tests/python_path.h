// python_path.h — the Python (with torch 2.x) that the Python-side tests run: the project's venv
// (scripts/torch-env.sh), passed in by CMake as FSDP_TEST_PYTHON. Without one, those tests
// report skipped with the reason, never passed.
#pragma once

#include <gtest/gtest.h>

#include <string>

#ifndef FSDP_TEST_PYTHON
#define FSDP_TEST_PYTHON ""
#endif

namespace fsdp_test {

// The interpreter, quoted for a shell command line.
inline std::string python() { return std::string("'") + FSDP_TEST_PYTHON + "'"; }

}  // namespace fsdp_test

// Skips the calling test when no Python with torch was configured.
#define FSDP_SKIP_WITHOUT_PYTHON()                                                       \
  do {                                                                                   \
    if (std::string(FSDP_TEST_PYTHON).empty())                                           \
      GTEST_SKIP() << "no Python with torch configured (FSDP_PYTHON is empty: run "      \
                      "scripts/install-deps.sh, or pass -DFSDP_PYTHON=/path/to/python)"; \
  } while (0)
