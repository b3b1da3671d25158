// main() of fsdp_mpi_tests, run by mpirun on every rank: the usual gtest main. Returning from
// main() runs the MPI backend's exit handler, which finalises MPI.
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
