// main() of fsdp_tests: the usual gtest main, plus the child-process exit of the harness.
#include "harness/multiprocess.h"

#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  if (fsdp::testing::is_child()) fsdp::testing::exit_child(rc);
  return rc;
}
