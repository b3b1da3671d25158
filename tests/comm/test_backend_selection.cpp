// Choosing the process-group backend: gloo by default under a torchrun-style launch (fsdprun),
// explicit choices by option and by FSDP_BACKEND, and errors that name where a bad name came
// from. The MPI backend's own tests run under mpirun (fsdp_mpi_tests, tests/mpi/).
#include "harness/multiprocess.h"

#include <fsdp/distributed.h>

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace {

// The error init_process_group throws for a world of one with `options`, or "" if none.
std::string init_error(const fsdp::InitOptions& options) {
  try {
    fsdp::init_process_group(fsdp::RendezvousInfo(), options);
  } catch (const c10::Error& e) {
    return e.what();
  }
  fsdp::destroy_process_group();
  return "";
}

}  // namespace

TEST(Backend, GlooIsTheDefaultUnderATorchrunStyleLaunch) {
  for (int world : {1, 2}) {
    fsdp::testing::run_distributed(world, [] { EXPECT_EQ(fsdp::backend(), "gloo"); });
  }
}

TEST(Backend, AnUnknownNameIsRefusedNamingTheOptionOrTheVariable) {
  fsdp::testing::run_distributed(1, [] {
    fsdp::destroy_process_group();  // this test initialises by itself
    const std::string by_option = init_error(fsdp::InitOptions().backend("ucc"));
    EXPECT_NE(by_option.find("fsdp::InitOptions().backend='ucc' is not a process-group backend; use gloo, mpi"),
              std::string::npos)
        << by_option;
    // nccl is a backend, but for a "cuda" mesh's groups, not for the world.
    const std::string nccl = init_error(fsdp::InitOptions().backend("nccl"));
    EXPECT_NE(nccl.find("the world group stays on a CPU backend"), std::string::npos) << nccl;
    ::setenv("FSDP_BACKEND", "tcp", 1);
    const std::string by_env = init_error(fsdp::InitOptions().backend("gloo"));  // the variable wins
    ::unsetenv("FSDP_BACKEND");
    EXPECT_NE(by_env.find("FSDP_BACKEND='tcp' is not a process-group backend"), std::string::npos) << by_env;
    EXPECT_FALSE(fsdp::is_initialized());
    fsdp::init_process_group(fsdp::RendezvousInfo());
  });
}

TEST(Backend, GlooCanBeChosenUnderMpiLaunchVariables) {
  fsdp::testing::run_distributed(1, [] {
    fsdp::destroy_process_group();
    fsdp::RendezvousInfo info;
    info.source = "openmpi";  // as under mpirun -np 1
    fsdp::init_process_group(info, fsdp::InitOptions().backend("gloo"));
    EXPECT_EQ(fsdp::backend(), "gloo");
    fsdp::destroy_process_group();
    ::setenv("FSDP_BACKEND", "gloo", 1);
    fsdp::init_process_group(info, fsdp::InitOptions().backend("mpi"));
    ::unsetenv("FSDP_BACKEND");
    EXPECT_EQ(fsdp::backend(), "gloo");
  });
}

TEST(Backend, MpiInABuildWithoutMpiIsRefusedSayingSo) {
  if (fsdp::mpi_available()) GTEST_SKIP() << "this build has MPI (the refusal is for builds without it)";
  fsdp::testing::run_distributed(1, [] {
    fsdp::destroy_process_group();
    const std::string e = init_error(fsdp::InitOptions().backend("mpi"));
    EXPECT_NE(e.find("this build of fsdp-cpp has no MPI backend"), std::string::npos) << e;
    fsdp::init_process_group(fsdp::RendezvousInfo());
  });
}
